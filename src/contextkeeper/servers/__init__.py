"""Who is at the other end: server kinds read from replies (:mod:`.kinds`), each server's preprocessing
(:mod:`.dialects`), asking a server what it is (:mod:`.detection`) and measuring its limits (:mod:`.calibration`),
over the small HTTP helpers in :mod:`.http`."""

from .._exceptions import DetectionWarning
from .calibration import Calibration, Probe, ProbeResult, calibrate
from .detection import Detection, detect_server
from .dialects import Dialect, dialect_of

__all__ = [
    "Calibration",
    "Detection",
    "DetectionWarning",
    "Dialect",
    "Probe",
    "ProbeResult",
    "calibrate",
    "detect_server",
    "dialect_of",
]
