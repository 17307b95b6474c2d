"""valora scheduler: owns the request queue and places requests on workers (see policies/)."""
