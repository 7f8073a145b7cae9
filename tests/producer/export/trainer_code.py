"""The trainers' own dataset code, imported from the releases tests/trainers.txt pins.

scripts/setup --tests installs llamafactory, specforge and speculators with --no-deps; this
module imports their pure-Python data modules as they are (nothing of theirs is copied or
changed) and puts the least in place of what a machine without torch or a GPU lacks:

- the package `__init__` files are skipped (a bare package over the installed folder):
  llamafactory's, llamafactory.data's and speculators' import their model stacks (torch);
- torch: a numpy-backed stand-in (`zeros`, `ones_like`, `tensor`, `long`, `Tensor`, and the
  names `torch.nn.functional`, `torch.distributed`, `torch.utils.data.Dataset` that the modules
  bind at import), in sys.modules only while they are imported, so nothing else sees it;
- peft.utils (not installed): the two file-name constants llamafactory/extras/constants.py
  imports, with peft's values;
- llamafactory.extras.misc (torch, transformers internals): `use_modelscope` and
  `use_openmind`, the two names data/parser.py imports, as misc.py defines them;
- specforge.distributed (torch.distributed, yunchang): the two group getters
  specforge/data/preprocessing.py imports, never called on the dataset path.

The numpy stand-in is why SpecForge's rows come back as numpy arrays where the trainer has
tensors: the same integers (the last step of both builders, `set_format(type="torch")`, is run
as `set_format(type="numpy")`: numpy_for_torch_format).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

PINS_FILE = Path(__file__).resolve().parents[2] / "trainers.txt"


def pins() -> dict[str, str]:
    """tests/trainers.txt: distribution name -> pinned version."""
    out = {}
    for line in PINS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name] = version
    return out


def require_pinned() -> None:
    """Every pinned trainer installed at its pinned version (scripts/setup --tests)."""
    for name, version in pins().items():
        try:
            got = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError(f"{name} is not installed: run scripts/setup --tests") from None
        if got != version:
            raise RuntimeError(f"{name} {got} is installed, tests/trainers.txt pins {version}: run scripts/setup --tests")


def _folder(top: str) -> Path:
    spec = importlib.util.find_spec(top)  # a top-level package's spec: found, not imported
    assert spec is not None and spec.submodule_search_locations, top
    return Path(next(iter(spec.submodule_search_locations)))


def _bare(name: str, folder: Path) -> None:
    """NAME as a package over FOLDER whose __init__ is not run."""
    if name in sys.modules:
        return
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    mod = importlib.util.module_from_spec(spec)
    mod.__path__ = [str(folder)]
    sys.modules[name] = mod


def _module(name: str, **attrs: Any) -> ModuleType:
    mod = ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _torch() -> dict[str, ModuleType]:
    """The numpy-backed torch stand-in: only what the imported data paths call."""

    def zeros(*shape: int, dtype: Any = None) -> np.ndarray[Any, Any]:
        return np.zeros(shape, dtype=dtype or np.float32)

    def ones_like(t: np.ndarray[Any, Any], dtype: Any = None) -> np.ndarray[Any, Any]:
        return np.ones_like(t, dtype=dtype)

    def tensor(data: Any, dtype: Any = None) -> np.ndarray[Any, Any]:
        return np.asarray(data, dtype=dtype)

    functional = _module("torch.nn.functional")
    nn = _module("torch.nn", functional=functional)
    data = _module("torch.utils.data", Dataset=type("Dataset", (), {}), DataLoader=object,
                   DistributedSampler=object)
    utils = _module("torch.utils", data=data)
    distributed = _module("torch.distributed")
    torch = _module("torch", long=np.int64, float=np.float32, Tensor=np.ndarray, zeros=zeros,
                    ones_like=ones_like, tensor=tensor, nn=nn, utils=utils, distributed=distributed)
    return {"torch": torch, "torch.nn": nn, "torch.nn.functional": functional, "torch.utils": utils,
            "torch.utils.data": data, "torch.distributed": distributed}


@contextmanager
def _standing_in(mods: dict[str, ModuleType]) -> Iterator[None]:
    """MODS in sys.modules for the imports inside, then gone (the modules keep what they bound)."""
    clash = [name for name in mods if name in sys.modules]
    assert not clash, f"already imported, not stood in for: {clash}"
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name in mods:
            sys.modules.pop(name, None)


def _prime_real_imports() -> None:
    """Import, before any stand-in exists, every third-party name the trainers' modules import,
    so none of those libraries sees the torch stand-in (transformers and datasets decide once
    whether torch is there)."""
    import datasets  # noqa: F401
    import httpx  # noqa: F401
    import huggingface_hub  # noqa: F401
    import openai  # noqa: F401
    import pydantic  # noqa: F401
    import tqdm  # noqa: F401
    import transformers
    import transformers.dynamic_module_utils
    import transformers.utils

    assert not transformers.utils.is_torch_available()
    for name in ("PreTrainedTokenizer", "PreTrainedTokenizerBase", "ProcessorMixin", "AutoProcessor", "AutoConfig"):
        getattr(transformers, name)


_loaded: dict[str, SimpleNamespace] = {}


def llamafactory() -> SimpleNamespace:
    """LLaMA-Factory's data.converter (align_dataset, the converters), data.parser (DatasetAttr,
    get_dataset_list) and data.formatter (FunctionFormatter, ToolFormatter)."""
    if "llamafactory" not in _loaded:
        require_pinned()
        _prime_real_imports()
        root = _folder("llamafactory")
        for name, folder in (("llamafactory", root), ("llamafactory.data", root / "data"),
                             ("llamafactory.extras", root / "extras")):
            _bare(name, folder)
        import os

        def is_env_enabled(env_var: str, default: str = "0") -> bool:  # extras/misc.py's, verbatim
            return os.getenv(env_var, default).lower() in ["true", "y", "1"]

        misc = _module("llamafactory.extras.misc",
                       use_modelscope=lambda: is_env_enabled("USE_MODELSCOPE_HUB"),
                       use_openmind=lambda: is_env_enabled("USE_OPENMIND_HUB"))
        peft = _module("peft")
        peft_utils = _module("peft.utils", SAFETENSORS_WEIGHTS_NAME="adapter_model.safetensors",
                             WEIGHTS_NAME="adapter_model.bin")
        with _standing_in({"peft": peft, "peft.utils": peft_utils, "llamafactory.extras.misc": misc}):
            converter = importlib.import_module("llamafactory.data.converter")
            parser = importlib.import_module("llamafactory.data.parser")
            formatter = importlib.import_module("llamafactory.data.formatter")
        _loaded["llamafactory"] = SimpleNamespace(converter=converter, parser=parser, formatter=formatter)
    return _loaded["llamafactory"]


def specforge() -> SimpleNamespace:
    """SpecForge's specforge.data.preprocessing (build_eagle3_dataset) and its template registry."""
    if "specforge" not in _loaded:
        require_pinned()
        _prime_real_imports()
        distributed = _module("specforge.distributed", get_draft_sp_group=_never("get_draft_sp_group"),
                              get_sp_ring_group=_never("get_sp_ring_group"))
        with _standing_in({**_torch(), "specforge.distributed": distributed}):
            preprocessing = importlib.import_module("specforge.data.preprocessing")
            template = importlib.import_module("specforge.data.template")
        _loaded["specforge"] = SimpleNamespace(preprocessing=preprocessing, template=template)
    return _loaded["specforge"]


def speculators() -> SimpleNamespace:
    """speculators' data_generation.preprocessing (load_raw_dataset, build_speculator_training_dataset)."""
    if "speculators" not in _loaded:
        require_pinned()
        _prime_real_imports()
        root = _folder("speculators")
        for name, folder in (("speculators", root), ("speculators.train", root / "train")):
            _bare(name, folder)
        with _standing_in(_torch()):
            preprocessing = importlib.import_module("speculators.data_generation.preprocessing")
        _loaded["speculators"] = SimpleNamespace(preprocessing=preprocessing)
    return _loaded["speculators"]


def _never(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"specforge.distributed.{name} is stood in for and is not on the dataset path")

    return call


@contextmanager
def numpy_for_torch_format() -> Iterator[None]:
    """`Dataset.set_format(type="torch")`, the last step of SpecForge's build_eagle3_dataset and
    of speculators' build_speculator_training_dataset, needs torch: inside, it is
    `set_format(type="numpy")` (the same integers, as numpy arrays)."""
    import datasets

    original = datasets.Dataset.set_format

    def set_format(self: Any, type: str | None = None, *args: Any, **kwargs: Any) -> None:
        original(self, "numpy" if type == "torch" else type, *args, **kwargs)

    datasets.Dataset.set_format = set_format  # type: ignore[method-assign]
    try:
        yield
    finally:
        datasets.Dataset.set_format = original  # type: ignore[method-assign]
