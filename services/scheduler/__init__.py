"""valora scheduler: owns the request queue and places requests on workers.

__main__.py    `python -m services.scheduler`: run until SIGTERM/SIGINT
config.py      SchedulerSettings (env VALORA_<FIELD>)
server.py      create_server: worker pool, dispatcher, SchedulerService
service.py     the SchedulerService servicer: admits requests, runs them, relays output
dispatcher.py  the bounded queue and the loop that asks the policy where requests go
workers.py     the worker pool: a channel per worker, status pushed or polled → WorkerView
policies/      the placement policies and their registry (POLICIES, make_policy)
credits.py     credits of waiting requests (VaLoRA Alg. 1), deadlines of latency objectives
cost_model.py  execution-time estimates: engine step, LoRA term, mode switch, adapter load
slo.py         per-application latency objectives (Task.slo_ms, slo_class)
sim.py         discrete-event simulator running the real policies on the cost model
sim_bench.py   `valora bench sched`'s runs of the simulator (entry point scheduler-sim)
traces.py      request traces for the simulator (synthetic, Azure CSV, two-app)
"""
