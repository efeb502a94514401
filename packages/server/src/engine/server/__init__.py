"""The engine's OpenAI-compatible server and its ``engine`` command line."""
