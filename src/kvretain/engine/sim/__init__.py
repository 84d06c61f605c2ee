"""Serving simulator: virtual-time engine, cost models and hardware/model catalogs (torch-free).

SimConfig, Simulation, simulate   the discrete-event loop over replicas behind a router
SimRequest                        a workload request that hashes its own blocks cheaply
SimExecutor                       prices a SchedulerOutput with the cost model
ROUTERS                           round-robin, least-loaded, prefix-affinity, prefix-memory
"""
