"""any OpenAI-compatible server (attach only): the adapter (adapter.py).

Empty on purpose: importing the rules must not load the adapter."""
