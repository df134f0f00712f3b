"""Data pipeline: tokenizers, the .bin/.idx indexed dataset, GPT and blended datasets,
and the batch builder / data-parallel iterator.

The names below are the package's public API. They are imported on first use, so that
tools which only tokenize (tools/preprocess_data.py and its workers) never import torch.
"""
import importlib

_EXPORTS = {
    "batch": ("DataParallelBatchSampler", "build_data_iterator", "get_ltor_batch"),
    "blended_dataset": ("BlendedDataset", "build_blending_indices"),
    "builder": ("build_train_valid_test_datasets",),
    "gpt_dataset": ("GPTDataset", "MockGPTDataset", "MockIndexedDataset"),
    "indexed_dataset": ("DTYPE_CODES", "IndexedDataset", "IndexedDatasetBuilder",
                        "data_file_path", "index_file_path", "optimal_dtype"),
    "tokenizers": ("TOKENIZER_TYPES", "build_tokenizer", "tokenizer_from_config"),
    "utils": ("get_split_ranges", "parse_and_normalize_split", "parse_data_path"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
