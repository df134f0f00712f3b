"""The data section: what the samples are (length, files, split, tokenizer, document
handling, loader processes) and Megatron-LM's fill-in-the-middle transformation."""
from dataclasses import dataclass

from megatron_cp.config.setting import check_choices, setting

# Megatron-LM reads these three with one sentencepiece wrapper (ids as encoded, eod = eos)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + ("GPT2BPETokenizer", "HuggingFaceTokenizer",
                                         "TikTokenizer", "NullTokenizer")
# Megatron-LM's other tokenizer types, refused with the reason (one line each)
NOT_BUILT_TOKENIZERS = {
    **dict.fromkeys(("BertWordPieceLowerCase", "BertWordPieceCase"),
                    "BERT's WordPiece tokenizer (a vocab.txt, [CLS]/[SEP] ids) is not built; use "
                    "HuggingFaceTokenizer with the BERT tokenizer's folder"),
    **dict.fromkeys(("MultimodalTokenizer", "NullMultimodalTokenizer"),
                    "multimodal tokenizers (image tokens, prompt formats) are for Megatron-LM's "
                    "vision-language models, which are not built"),
    "SFTTokenizer": "the SFT tokenizer's prompt formats are for supervised fine-tuning, which "
                    "is not built (megatron_cp pretrains on token data)",
}
# TikTokenizer's special tokens: those it must have, in this order by default (Megatron-LM's)
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB = 2 ** 17  # TikTokenizer's vocabulary without --vocab-size


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    seq_length: int = setting(group="model", help="Training sequence length.")
    data_path: tuple[str, ...] | None = setting(None, nargs="*", group="data",
        help="Dataset prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'.")
    split: str = setting("969,30,1", group="data", help="Train,valid,test split weights.")
    mock_data: bool = setting(False, group="data",
        help="Synthetic tokens instead of --data-path.")
    data_cache_path: str | None = setting(None, group="data",
        help="Where index files are cached.")
    mmap_bin_files: bool = setting(True,
        flag="--no-mmap-bin-files", arg="mmap_bin_files", store_false=True, group="data",
        help="Do not memory-map the .bin token files: read each sample with a positioned file "
             "read (for file systems where mmap is slow or absent).")
    tokenizer_type: str | None = setting(
        None, choices=TOKENIZER_TYPES + tuple(NOT_BUILT_TOKENIZERS) + (None,), group="data",
        help="Tokenizer class. Llama2Tokenizer and GPTSentencePieceTokenizer are "
             "SentencePieceTokenizer (Megatron-LM's one sentencepiece wrapper); TikTokenizer "
             "needs the tiktoken package. Megatron-LM's BERT, multimodal and SFT tokenizers "
             "are refused.")
    tokenizer_model: str | None = setting(None, group="data",
        help="sentencepiece model file, (HuggingFaceTokenizer) a local tokenizer folder or "
             "tokenizer.json file, or (TikTokenizer) its vocabulary .json.")
    vocab_file: str | None = setting(None, group="data", help="GPT-2 vocab.json.")
    merge_file: str | None = setting(None, group="data", help="GPT-2 merges.txt.")
    vocab_size: int | None = setting(None, group="data",
        help="Vocab size for NullTokenizer; TikTokenizer's vocabulary (default 2^17, special "
             "tokens included).")
    tiktoken_pattern: str | None = setting(None, choices=("v1", "v2", None), group="data",
        help="TikTokenizer's pre-tokenization regex: Megatron-LM's v1 or v2 (default v2).")
    tiktoken_num_special_tokens: int = setting(1000, group="data",
        help="TikTokenizer: ids below this are special tokens (--tokenizer-special-tokens, then "
             "<SPECIAL_i> fillers); the vocabulary's tokens follow.")
    special_tokens: tuple[str, ...] | None = setting(
        None, flag="--tokenizer-special-tokens", arg="special_tokens", group="data",
        help="TikTokenizer's special tokens, ids 0, 1, ... (default " +
             " ".join(TIKTOKEN_SPECIAL_TOKENS) + "; a list must include those).")
    tokenizer_hf_no_include_special_tokens: bool = setting(False, group="data",
        help="HuggingFaceTokenizer: encode text without the special tokens (bos, ...) the "
             "tokenizer adds, and decode without them (Megatron-LM's default includes them).")
    reset_position_ids: bool = setting(False, group="data",
        help="Restart position ids after each EOD.")
    reset_attention_mask: bool = setting(False, group="data",
        help="Keep attention inside documents.")
    eod_mask_loss: bool = setting(False, group="data", help="No loss on EOD tokens.")
    dataloader_inter_document_masking: bool = setting(False, group="data",
        help="Keep attention inside the documents a sample was assembled from (the dataset "
             "index's documents, not EOD tokens) and restart position ids at 0 where each "
             "begins (Megatron-LM's cu_seqlens); --reset-position-ids and "
             "--reset-attention-mask then change nothing, --eod-mask-loss still applies.")
    num_workers: int = setting(2, group="data",
        help="DataLoader worker processes per rank (Megatron-LM's default 2; 0: the rank reads "
             "its samples itself).")
    # Fill-in-the-middle samples (megatron_cp/data/fim.py); Megatron-LM's flags and defaults
    fim_data: bool = setting(False, group="data",
        help="Fill-in-the-middle samples (megatron_cp/data/fim.py) from --data-path.")
    fim_rate: float = setting(0.5, group="data",
        help="Probability that a segment becomes a FIM sample.")
    fim_spm_rate: float = setting(0.5, group="data",
        help="Probability that a FIM sample takes the SPM order over PSM.")
    fim_split_sample: str | None = setting(None, group="data",
        help="A token at which a sample is split into fragments, each FIM'd apart.")
    fim_fragment_rate: float | None = setting(None, group="data",
        help="With --fim-split-sample: the FIM probability of each fragment.")
    fim_no_prefix: str | None = setting(None, group="data",
        help="Segments whose text starts with this string are not FIM'd.")
    fim_prefix_token: str = setting("<fim_prefix>", group="data",
                                    help="FIM prefix token (default <fim_prefix>).")
    fim_middle_token: str = setting("<fim_middle>", group="data",
                                    help="FIM middle token (default <fim_middle>).")
    fim_suffix_token: str = setting("<fim_suffix>", group="data",
                                    help="FIM suffix token (default <fim_suffix>).")
    fim_pad_token: str = setting("<fim_pad>", group="data",
                                 help="FIM pad token (default <fim_pad>).")
    fim_eod_token: str = setting("<|endoftext|>", group="data",
                                 help="FIM eod token (default <|endoftext|>).")

    def __post_init__(self):
        check_choices(self)
        self._check_tiktoken()
        self._check_fim()

    def _check_tiktoken(self):
        """TikTokenizer's settings go with it (its own rules: data/tokenizers.py)."""
        given = [f"{flag} {value}" for flag, value, default in (
            ("--tiktoken-pattern", self.tiktoken_pattern, None),
            ("--tiktoken-num-special-tokens", self.tiktoken_num_special_tokens, 1000),
            ("--tokenizer-special-tokens", " ".join(self.special_tokens or ()), ""))
            if value != default]
        if self.tokenizer_type != "TikTokenizer" and given:
            raise ValueError(f"{', '.join(given)}: read by --tokenizer-type TikTokenizer only "
                             f"(megatron_cp adds no special tokens to its other tokenizers); "
                             f"drop {'it' if len(given) == 1 else 'them'}")

    def _check_fim(self):
        """Megatron-LM's FIM rules."""
        given = [flag for flag, value in (("--fim-split-sample", self.fim_split_sample),
                                          ("--fim-fragment-rate", self.fim_fragment_rate),
                                          ("--fim-no-prefix", self.fim_no_prefix))
                 if value is not None]
        if not self.fim_data:
            if given:
                raise ValueError(f"{', '.join(given)} only apply with --fim-data; add --fim-data "
                                 f"or drop {'them' if len(given) > 1 else 'it'}")
            return
        if self.mock_data:
            raise ValueError("--fim-data transforms the text of --data-path documents; the mock "
                             "dataset has none (Megatron-LM refuses it too): give --data-path "
                             "and a tokenizer with the FIM tokens instead of --mock-data")
        for flag, rate in (("--fim-rate", self.fim_rate), ("--fim-spm-rate", self.fim_spm_rate)):
            if not 0.0 < rate <= 1.0:
                raise ValueError(f"{flag} ({rate}) must be in (0, 1] with --fim-data "
                                 f"(Megatron-LM refuses 0); drop --fim-data for no FIM")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise ValueError("--fim-split-sample needs --fim-fragment-rate (the FIM probability "
                             "of each fragment)")
        if self.fim_fragment_rate is not None and not 0.0 <= self.fim_fragment_rate <= 1.0:
            raise ValueError(f"--fim-fragment-rate ({self.fim_fragment_rate}) is a probability: "
                             f"give a value from 0 to 1")
        if self.tokenizer_type in (None, "NullTokenizer"):
            raise ValueError(f"--fim-data needs a tokenizer that has the FIM tokens and turns ids "
                             f"into text, not {self.tokenizer_type or 'NullTokenizer'}; give "
                             f"--tokenizer-type GPT2BPETokenizer, SentencePieceTokenizer or "
                             f"HuggingFaceTokenizer")
