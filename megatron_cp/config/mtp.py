"""The model's multi-token prediction part (DeepSeek-V3; model/multi_token_prediction.py)."""
from dataclasses import dataclass

from megatron_cp.config.setting import setting


@dataclass(kw_only=True, frozen=True)
class MTPSettings:
    """Multi-token prediction's settings, part of :class:`~megatron_cp.config.model.GPTConfig`."""
    mtp_num_layers: int | None = setting(
        None, shapes=True,
        help="Multi-token prediction depths (DeepSeek-V3): depth k predicts the token k+1 "
             "positions ahead from depth k-1's hidden states and the embedding of the token k "
             "ahead, with one transformer layer of the last decoder layer's kind, sharing the "
             "embedding and output layer (default: none).")
    mtp_loss_scaling_factor: float = setting(
        0.1, help="Weight of the MTP loss: the mean over the depths of their token-mean cross "
                  "entropies, times this factor, is added to the training loss.")
    mtp_use_repeated_layer: bool = setting(
        False, shapes=True, help="Build one MTP layer and run it at every depth (its weights "
                                 "shared over the depths).")

    def _check_mtp(self):
        """Multi-token prediction's rules (Megatron-LM's validate_args)."""
        if self.mtp_num_layers is None:
            if self.mtp_use_repeated_layer:
                raise ValueError("mtp_use_repeated_layer (True) repeats an MTP layer, but "
                                 "mtp_num_layers is None: add --mtp-num-layers or drop it")
            return
        if self.mtp_num_layers < 1:
            raise ValueError(f"mtp_num_layers ({self.mtp_num_layers}) must be >= 1; leave "
                             f"--mtp-num-layers out for no multi-token prediction")
        if self.position_embedding_type not in ("rope", "yarn", "none"):
            raise ValueError(f"multi-token prediction (mtp_num_layers {self.mtp_num_layers}) "
                             f"needs position_embedding_type rope or none (Megatron-LM's rule), "
                             f"not {self.position_embedding_type!r}: use --position-embedding-"
                             f"type rope")

    def mtp_depths(self):
        """The number of MTP depths (0 without multi-token prediction)."""
        return self.mtp_num_layers or 0
