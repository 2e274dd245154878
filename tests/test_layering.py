"""The dependency rule of docs/architecture.md, checked on the real import graph."""

import subprocess
import sys


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_router_and_tokenizer_do_not_import_torch():
    loaded = _modules_loaded_by("import router, engine.tokenizer, engine.detokenizer, pdserve.system; "
                                "engine.tokenizer.load_tokenizer('default'); pdserve.system.ServeConfig().engine_config()")
    assert "engine.tokenizer" in loaded
    assert "torch" not in loaded
