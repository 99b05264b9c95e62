"""Diagnostics: ``doctor`` (symptom -> pool -> causes -> fixes), ``profile`` (the VRAM test
sequence, measured) and ``MemoryMonitor`` (leaks and fragmentation across requests).

Nothing here imports torch, transformers or matplotlib until a function needs them.
"""

from .doctor import Cause, Diagnosis, Evidence, Facts, Fix, Symptom, UnknownSymptom, diagnose, symptoms
from .monitor import Finding, HostMemory, MemoryMonitor, MonitorReport, ProcessUse, Reading, Sample, host_memory
from .profile import (
    Jump,
    LoadedModel,
    ProfileReport,
    ProfileRow,
    ProfileSettings,
    cache_bytes,
    load_model,
    plot_profile,
    profile,
)

__all__ = [
    "Cause",
    "Diagnosis",
    "Evidence",
    "Facts",
    "Finding",
    "Fix",
    "HostMemory",
    "Jump",
    "LoadedModel",
    "MemoryMonitor",
    "MonitorReport",
    "ProcessUse",
    "ProfileReport",
    "ProfileRow",
    "ProfileSettings",
    "Reading",
    "Sample",
    "Symptom",
    "UnknownSymptom",
    "cache_bytes",
    "diagnose",
    "host_memory",
    "load_model",
    "plot_profile",
    "profile",
    "symptoms",
]
