"""The lab: servelab's own EngineCore (Scheduler, BlockManager) on a virtual clock, with a cost model in
place of the model, to answer "what would this deployment do under this load?" for datacenter GPUs.

catalog/    GPUs and models (data/*.json), this machine's CPU profile
sim/        deployments (shape and memory), simulated instances, the load balancer, the event loop
analysis/   meters, evaluation, advisor and its decisions, sweeps, text reports
calibrate/  profile the real engine, fit the cost model to it, validate the lab against real runs
api.py      the typed lab API that both front-ends call
cli.py, web/  the front-ends: `servelab lab ...` and the /lab page
Kept free of imports, so that `import servelab.lab.sim` stays light. The simulator's compiled modules are
switched on by SERVELAB_COMPILED (servelab/compiled), not by importing the lab.
"""
