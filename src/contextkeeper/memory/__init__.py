"""GPU memory model: KV cache per layer kind and runtime, weights, overhead, GPUs, and plans."""

from .dtypes import DType, dtype
from .gpus import GPU, DetectedGPU, detect_gpus, find_gpu, gpu_catalog
from .layers import ChunkedAttention, FullAttention, LayerSpec, MLAttention, NoCache, RecurrentState, SlidingAttention
from .model import ModelSpec
from .plan import Advice, Breakdown, Plan, PlanSettings, Recommendation, plan, recommend
from .runtimes import KVReport, RuntimeSettings, kv_report
from .weights import ParamCount, WeightsReport, param_count, weights_report

__all__ = [
    "GPU",
    "Advice",
    "Breakdown",
    "ChunkedAttention",
    "DType",
    "DetectedGPU",
    "FullAttention",
    "KVReport",
    "LayerSpec",
    "MLAttention",
    "ModelSpec",
    "NoCache",
    "ParamCount",
    "Plan",
    "PlanSettings",
    "Recommendation",
    "RecurrentState",
    "RuntimeSettings",
    "SlidingAttention",
    "WeightsReport",
    "detect_gpus",
    "dtype",
    "find_gpu",
    "gpu_catalog",
    "kv_report",
    "param_count",
    "plan",
    "recommend",
    "weights_report",
]
