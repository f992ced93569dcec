"""The lab: servelab's own Scheduler and BlockManager on a virtual clock, with a cost model in place of
the model, to answer "what would this deployment do under this load?" for datacenter GPUs.

workload.py (seeded arrivals and lengths, shared with the load generator), catalog.py (GPUs, models),
deployment.py (shapes and memory), instance.py + simulate.py (the event loop), meters.py, advisor.py,
sweep.py, cli.py (`servelab lab simulate | advise | sweep`). Kept free of imports here so that
`import servelab.lab.workload` stays light.
"""
