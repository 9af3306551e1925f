"""Goodput under SLOs: per policy, the highest arrival-rate scale at which a set share of requests
meets both a TTFT and a TPOT objective, found by bisection over the simulator (`kvgate bench goodput`)."""
