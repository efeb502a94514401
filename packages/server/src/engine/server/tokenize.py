"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).

``/tokenize`` takes ``prompt`` (text) or ``messages`` (rendered with the chat template)
and returns ``{count, max_model_len, tokens, token_strs}``; ``/detokenize`` takes
``tokens`` and returns ``{prompt}``.

Both do their work, JSON encoding of the answer included, on the engine's tokenizer pool:
a body near ``--max-request-bytes`` takes seconds to tokenize, and the event loop keeps
serving everyone else meanwhile.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.core.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError
from engine.server.chat import render_chat
from engine.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from engine.server.state import server_state

router = APIRouter()


def _json(content: Any) -> Response:
    return Response(json.dumps(content, ensure_ascii=False, separators=(",", ":")),
                    media_type="application/json")


def _tokenize(tokenizer: Tokenizer, body: TokenizeRequest, max_model_len: int) -> Response:
    if isinstance(body, TokenizeChatRequest):
        text = render_chat(tokenizer, body.messages,
                           add_generation_prompt=body.add_generation_prompt,
                           template_kwargs=body.chat_template_kwargs)
    else:
        text = body.prompt
    tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return _json({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                  "token_strs": token_strs})


def _detokenize(tokenizer: Tokenizer, tokens: list[int], vocab_size: int) -> Response:
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise ValidationError(f"token id {token} is out of range; the vocabulary has "
                                  f"{vocab_size} tokens", param="tokens")
    return _json({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """Token ids of a text or of a rendered conversation."""
    state = server_state(request)
    state.check_model(body.model)
    engine = state.engine
    return await engine.tokenizer_pool.run(_tokenize, engine.tokenizer, body,
                                           engine.max_model_len)


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    """The text of a list of token ids."""
    state = server_state(request)
    state.check_model(body.model)
    engine = state.engine
    return await engine.tokenizer_pool.run(_detokenize, engine.tokenizer, body.tokens,
                                           engine.setup.vocab_size)
