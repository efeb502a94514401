"""The built-in tool-call parsers, registered in ``engine.tool_parsers``."""

from engine.server.tool_parsers.hermes import HermesToolParser
from engine.server.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = ["HermesToolParser", "Llama3JsonToolParser"]
