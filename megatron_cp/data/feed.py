"""What a training run reads: the datasets of ``--data-path`` / ``--split`` (or mock data) and
each step's microbatches for this rank.

Only TP rank 0 of each group reads (its TP peers receive the batch by broadcast); each
microbatch is padded to the step's length and, for CP, partitioned
(``megatron_cp.data.microbatch`` holds that rule). :meth:`DataFeed.close` ends the loader
processes (``--num-workers``) when the run ends.
"""
import torch
import torch.distributed as dist

from megatron_cp.data.batch import (add_mtp_targets, build_data_iterator, close_data_iterator,
                                    get_ltor_batch, text_and_documents)
from megatron_cp.context_parallel.dynamic_schedule import FlopCost
from megatron_cp.data.builder import build_train_valid_test_datasets
from megatron_cp.data.dynamic_feed import dynamic_microbatches
from megatron_cp.data.fim import FimTransform, fim_settings
from megatron_cp.data.microbatch import prepare_microbatch, required_length, split_multiple, step_length


class DataFeed:
    """The datasets and the per-step microbatches of one run, read from its sections:
    ``data`` (:class:`~megatron_cp.config.data.DataConfig`: the files, split, sample length,
    document handling, FIM and loader processes), ``training``
    (:class:`~megatron_cp.config.training.TrainingConfig`: the training and evaluation
    lengths and batch sizes), ``parallel`` (:class:`~megatron_cp.config.parallel.ParallelConfig`:
    --pipeline-seq-length) and ``model`` (:class:`~megatron_cp.config.model.GPTConfig`: the
    seed, the MTP depths and whether the sequence is also split over TP). ``state``: the
    run's ParallelState, ``tokenizer``: its tokenizer, ``batches``: its BatchSchedule."""

    def __init__(self, data, training, parallel, model, state, tokenizer, batches):
        self.data, self.training, self.parallel, self.model = data, training, parallel, model
        self.state, self.tokenizer = state, tokenizer
        self.batches = batches  # the global batch size at each sample (BatchSchedule)
        self.device = state.device
        self.reads = state.rank("tp") == 0  # TP peers receive their batch by broadcast
        self.datasets, self.train_iter, self.valid_dataset = {}, None, None
        self.valid_iter = None  # the latest validation pass's (closed with the feed)
        # checked on every rank at start-up: the tokenizer has the FIM tokens
        self.fim = FimTransform(fim_settings(data, tokenizer), tokenizer) \
            if data.fim_data else None

    def build(self, consumed_samples):
        """Build the datasets and the training iterator, which resumes after
        ``consumed_samples``."""
        d, t = self.data, self.training
        eval_rounds = ((t.train_iters // t.eval_interval if t.eval_interval else 0) + 1
                       if t.eval_iters > 0 else 0)
        num_samples = (self.batches.samples_after(t.train_iters),
                       eval_rounds * t.eval_iters * t.eval_global_batch_size,
                       t.eval_iters * t.eval_global_batch_size)
        train, valid, test = build_train_valid_test_datasets(
            d.data_path, d.split, num_samples, d.seq_length, self.model.seed, self.tokenizer,
            mock=d.mock_data, data_cache_path=d.data_cache_path,
            mmap_bin=d.mmap_bin_files, fim=self.fim,
            inter_document_masking=d.dataloader_inter_document_masking) \
            if self.reads else (None,) * 3
        self.datasets = {"train": train, "validation": valid, "test": test}  # for the banner
        self.train_iter = build_data_iterator(train, self.batches.global_batch_size,
                                              t.micro_batch_size, *self._reader_place(),
                                              consumed_samples, d.num_workers,
                                              t.exit_signal_handler)
        self.valid_dataset = valid

    def validation_iterator(self):
        """A fresh pass over the validation split, from its start, in evaluation batches
        (--eval-global-batch-size of --eval-micro-batch-size microbatches)."""
        t = self.training
        close_data_iterator(self.valid_iter)  # the previous pass's loader processes
        self.valid_iter = build_data_iterator(self.valid_dataset if self.reads else None,
                                              t.eval_global_batch_size, t.eval_micro_batch_size,
                                              *self._reader_place(), 0,
                                              self.data.num_workers, t.exit_signal_handler)
        return self.valid_iter

    @property
    def dynamic(self):
        """Dynamic context parallelism: every rank reads the whole global batch."""
        return self.parallel.dynamic_context_parallel

    def _reader_place(self):
        """(DP rank, DP size) the reader deals the global batch by: the whole batch to every
        rank under dynamic CP."""
        return (0, 1) if self.dynamic else (self.state.rank("dp"), self.state.size("dp"))

    def reads_per_step(self, num_microbatches):
        """Microbatches this rank reads per step of ``num_microbatches`` per DP rank."""
        return num_microbatches * (self.state.size("dp") if self.dynamic else 1)

    def close(self):
        """End the loader processes of the training and validation iterators (at the end of
        the run, also when it fails): a rank that ends with ``os._exit`` would leave them
        running (``close_data_iterator``)."""
        close_data_iterator(self.train_iter)
        close_data_iterator(self.valid_iter)

    def microbatches(self, iterator, count, micro_batch_size, first_sample=0):
        """This rank's ``count`` microbatches of ``micro_batch_size`` samples (one global
        batch), padded to the step's length and (for CP) partitioned. Each carries
        ``sample_ids`` [b]: its samples' numbers in the run's stream (``first_sample``, the
        samples consumed before this global batch, plus the index in the global batch, which
        DP rank d holds from d x G/DP on, as DataParallelBatchSampler deals them): attention
        dropout's mask follows them, so DP ranks drop what one process running the whole
        batch would. Under dynamic CP: this rank's bins instead (:meth:`_dynamic_microbatches`)."""
        st = self.state
        if self.dynamic:
            return self._dynamic_microbatches(iterator, count, micro_batch_size, first_sample)
        batches = self._read_batches(iterator, count, micro_batch_size)
        length = self._step_length(batches)
        first = first_sample + st.rank("dp") * count * micro_batch_size  # G/DP samples a rank
        prepared = []
        for m, batch in enumerate(batches):
            batch = prepare_microbatch(batch, st.rank("cp"), st.size("cp"), length)
            start = first + m * micro_batch_size
            batch["sample_ids"] = torch.arange(start, start + micro_batch_size,
                                               device=self.device)
            prepared.append(batch)
        return prepared

    def _dynamic_microbatches(self, iterator, count, micro_batch_size, first_sample):
        """Dynamic CP: this rank's bins of the global batch (``count`` microbatches per DP
        rank; megatron_cp.data.dynamic_feed), each with its ``cp_size``."""
        st, m, p = self.state, self.model, self.parallel
        batches = self._read_batches(iterator, count * st.size("dp"), micro_batch_size)
        cost = FlopCost.for_model(m.hidden_size, m.ffn_hidden_size, m.num_layers,
                                  m.num_attention_heads, m.num_query_groups, m.kv_channels,
                                  gated_mlp=m.activation == "swiglu")
        tp_multiple = st.size("tp") if m.sequence_parallel else 1
        prepared, self.last_schedule = dynamic_microbatches(
            batches, st.rank("dp_cp"), st.size("dp_cp"), p.max_seqlen_per_dp_cp_rank, cost,
            tp_multiple, p.min_dynamic_context_parallel_size, first_sample, st.size("cp"),
            lockstep=st.size("ep") > 1)
        return prepared

    def _read_batches(self, iterator, count, micro_batch_size):
        """``count`` microbatches from ``iterator`` as get_ltor_batch dicts (TP rank 0
        reads, its TP peers receive them)."""
        d = self.data
        batches = []
        for _ in range(count):
            text, documents = self._read(iterator, micro_batch_size)
            batches.append(add_mtp_targets(
                get_ltor_batch(text, self.tokenizer.eod, d.reset_position_ids,
                               d.reset_attention_mask, d.eod_mask_loss, document_ids=documents),
                self.model.mtp_depths()))
        return batches

    def _read(self, iterator, micro_batch_size):
        """One microbatch's ``text`` [b, s+1] and (--dataloader-inter-document-masking) the
        dataset's ``document_ids`` [b, s] (else None), on the device: TP rank 0 reads them,
        its TP peers receive them."""
        d = self.data
        text, documents = text_and_documents(next(iterator) if iterator is not None else None)
        if text is not None:
            self._check_token_ids(text)
            assert (documents is not None) == d.dataloader_inter_document_masking
        if self.state.size("tp") > 1:
            text = self._from_tp_rank_0(text, (micro_batch_size, d.seq_length + 1))
            if d.dataloader_inter_document_masking:
                documents = self._from_tp_rank_0(documents, (micro_batch_size, d.seq_length))
        return text.to(self.device), None if documents is None else documents.to(self.device)

    def _from_tp_rank_0(self, tensor, shape):
        """TP rank 0's int64 ``tensor`` of ``shape`` on every rank of its TP group (the
        others pass None)."""
        st = self.state
        tensor = (torch.empty(shape, dtype=torch.long) if tensor is None else tensor).to(self.device)
        dist.broadcast(tensor, src=st.group_ranks("tp")[0], group=st.group("tp"))
        return tensor

    def _check_token_ids(self, text):
        """Token ids beyond the tokenizer's vocabulary mean the data was tokenized with
        another tokenizer (or --vocab-size is too small): say so instead of an IndexError
        deep in the embedding (on the CPU copy the reader holds: no device sync)."""
        vocab = self.tokenizer.vocab_size
        largest = int(text.max())
        if largest >= vocab:
            raise ValueError(f"the training data holds token id {largest}, but the tokenizer "
                             f"has {vocab} tokens (ids 0..{vocab - 1}): tokenize the data with "
                             f"the tokenizer given here (NullTokenizer: --vocab-size at least "
                             f"{largest + 1})")

    def _step_length(self, batches):
        """The padded sample length of this step: --pipeline-seq-length when given (PP),
        else the longest sample once its documents are padded for CP, rounded up (to
        steps of about seq_length / 8 under PP, so buffer shapes rarely change) and, under
        PP, agreed over the pipeline group before any stage sends."""
        st = self.state
        cp, pp = st.size("cp"), st.size("pp")
        if pp > 1 and self.parallel.pipeline_seq_length:
            return self.parallel.pipeline_seq_length
        granularity = split_multiple(cp) * (st.size("tp") if self.model.sequence_parallel else 1)
        needed = max(required_length(batch, cp) for batch in batches)
        length = step_length(needed, self.data.seq_length, granularity, bucketed=pp > 1)
        if pp > 1:
            agreed = torch.tensor([length], dtype=torch.long, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=st.group("pp"))
            length = int(agreed.item())
        return length
