"""The model runtime: run a decoder with one KV strategy in charge of attention, and trace it.

`context` holds what a strategy sees (RunContext, Counters), `run` the prefill/decode loop
and its records, `command` the `kvbench run STRATEGY` commands built from the registry.
"""
