"""The job's processes: the process group, FSDP2 sharding, the watchdog that ends every rank on a fault, stop requests, the launcher."""
