"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).

``/tokenize`` takes ``prompt`` (text) or ``messages`` (rendered with the chat template)
and returns ``{count, max_model_len, tokens, token_strs}``; ``/detokenize`` takes
``tokens`` and returns ``{prompt}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.sdk.errors import ValidationError
from engine.server.chat import render_chat
from engine.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from engine.server.state import server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of a text or of a rendered conversation."""
    state = server_state(request)
    state.check_model(body.model)
    engine = state.engine
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        text = render_chat(tokenizer, body.messages,
                           add_generation_prompt=body.add_generation_prompt,
                           template_kwargs=body.chat_template_kwargs)
    else:
        text = body.prompt
    tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
            "token_strs": token_strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    """The text of a list of token ids."""
    state = server_state(request)
    state.check_model(body.model)
    engine = state.engine
    vocab_size = engine.setup.vocab_size
    for token in body.tokens:
        if not 0 <= token < vocab_size:
            raise ValidationError(f"token id {token} is out of range; the vocabulary has "
                                  f"{vocab_size} tokens", param="tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
