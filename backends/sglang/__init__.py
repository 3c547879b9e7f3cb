"""SGLang: the adapter (adapter.py), its KV rules (kvrules.py, imports only kvbench.kv).

Empty on purpose: importing the rules must not load the adapter."""
