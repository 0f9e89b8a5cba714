"""Restore onto another rank count or other nodes: plan over the old job's shards wherever
they survived (plan.py, pure), then read, rebuild, move and verify them (exchange.py)."""
