"""Who is at the other end: server kinds read from replies (:mod:`.kinds`), each server's preprocessing
(:mod:`.dialects`), asking a server what it is (:mod:`.detection`) and measuring its limits (:mod:`.calibration`),
over the small HTTP helpers in :mod:`.http`."""
