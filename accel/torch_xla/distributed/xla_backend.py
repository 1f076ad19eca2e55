"""Importing this registers the "xla" process-group backend and the "xla://" rendezvous."""
from accel.xla.backend import BACKEND_NAME, HostStagedProcessGroup, create_process_group, register

__all__ = ["BACKEND_NAME", "HostStagedProcessGroup", "create_process_group", "register"]
