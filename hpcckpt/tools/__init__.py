"""Offline tools over a run's directories, for one process: the catalog (inspect, export,
verify) and the report of a run across its attempts."""
