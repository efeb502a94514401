"""The constructors of ``SamplingParams`` and ``StructuredOutputsParams`` are typed as they run.

Both normalise what they are given in ``__post_init__`` (a list into a tuple, a mapping
into a ``StructuredOutputsParams``), so each declares, for type checkers only, an
``__init__`` that accepts those forms while its attributes keep the normalised types.
These tests check that a plugin's code using the documented forms type-checks under
``mypy --strict``, that the attributes read back as before, and that each declared
``__init__`` has the dataclass's fields, in order, with the same defaults.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.sdk import SamplingParams
from engine.sdk.structured_output import StructuredOutputsParams

USES = '''
from engine.sdk import SamplingParams
from engine.sdk.structured_output import StructuredOutputsParams

choice = StructuredOutputsParams(choice=["yes", "no"])
params = SamplingParams(temperature=0, stop=["\\n\\n"], stop_token_ids=[2],
                        structured_outputs={"choice": ["yes", "no"]})
one_stop = SamplingParams(stop="###", structured_outputs=choice)
# What readers see is unchanged: the normalised types.
kind: str = params.structured_outputs.kind if params.structured_outputs else ""
choices: tuple[str, ...] | None = choice.choice
stops: tuple[str, ...] = params.stop
stop_ids: tuple[int, ...] = params.stop_token_ids
'''


def test_the_documented_forms_type_check(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    module = tmp_path / "uses.py"
    module.write_text(USES)
    out, err, status = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"),
                                str(module)])
    assert status == 0, out + err


def test_the_documented_forms_run() -> None:
    exec(compile(USES, "uses.py", "exec"), {})
    params = SamplingParams(stop=["a"], stop_token_ids=[2],
                            structured_outputs={"choice": ["yes", "no"]})
    assert (params.stop, params.stop_token_ids) == (("a",), (2,))
    assert params.structured_outputs == StructuredOutputsParams(choice=("yes", "no"))


def _declared_init(cls: type) -> ast.FunctionDef:
    """The ``__init__`` ``cls`` declares under ``if TYPE_CHECKING:``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    [klass] = tree.body
    assert isinstance(klass, ast.ClassDef)
    for node in klass.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef) and inner.name == "__init__":
                    return inner
    raise AssertionError(f"{cls.__name__} declares no __init__ under TYPE_CHECKING")


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize("cls", [SamplingParams, StructuredOutputsParams],
                         ids=lambda c: c.__name__)
def test_the_declared_init_matches_the_fields(cls: type) -> None:
    init = _declared_init(cls)
    assert not init.args.args[1:] and init.args.vararg is None and init.args.kwarg is None
    declared = {arg.arg: ast.literal_eval(default) for arg, default in
                zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True)}
    fields = {f.name: _default(f) for f in dataclasses.fields(cls) if f.init}
    assert list(declared) == list(fields)
    assert declared == fields
