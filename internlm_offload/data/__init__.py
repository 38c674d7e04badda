"""The data pipeline: tokenizers, documents, packed samples, the step sampler and loader.

Importing `packed` registers the "builtin" and "text" dataset builders in `DATASETS`, `tokenized` the
"internevo" one (InternEvo's tokenized folders), `chat` the "chat" one (XTuner's chat jsonl).
"""

from internlm_offload.data.chat import build_chat_dataset
from internlm_offload.data.corpus import DataError, builtin_documents, read_documents
from internlm_offload.data.loader import StepLoader
from internlm_offload.data.packed import PackedDataset, build_builtin_dataset, build_text_dataset
from internlm_offload.data.sampler import StepSampler
from internlm_offload.data.tokenized import InternEvoPackedDataset, build_internevo_dataset
from internlm_offload.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "InternEvoPackedDataset",
    "PackedDataset",
    "StepLoader",
    "StepSampler",
    "Tokenizer",
    "build_builtin_dataset",
    "build_chat_dataset",
    "build_internevo_dataset",
    "build_text_dataset",
    "build_tokenizer",
    "builtin_documents",
    "read_documents",
]
