"""What several engines share and no engine owns: wire formats (OpenAI's completion chunks and model list),
the lines llama.cpp's server logs (Ollama's log carries them too), llama-server's KV rules and startup memory.
Engine folders import from here, never from one another."""
