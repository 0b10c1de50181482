"""The one engine policy: what a run's model runs on (its backend and, for ``openvino-int8``, its calibration texts),
and why. A command asks :func:`resolve` once and passes the :class:`EngineChoice` on: to ``Predictor.load``, to its
Ray actors (which never pick again on their own CPU) and into what it records (an index's manifest, :data:`RECORD_KEY`).

Rules, in order: a resolved choice is kept as it is; a static folder runs ``static``; ``graph``/``evaluate``:
:func:`pick_backend`; a build record with ``auto`` or its own backend: the record (an update refuses another backend);
a backend named: that backend; ``auto``: :func:`serve_choice` on this CPU (what ``encoderkit doctor`` states).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit import hardware
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import Choice, Hardware
from encoderkit.inference import engines
from encoderkit.inference.agreement import CARD_KEY, INT8_MIN_AGREEMENT, verdict
from encoderkit.inference.engines import BACKENDS, CALIBRATION_TEXTS, DEFAULT_CALIBRATION, STATIC, TORCH_INT8
from encoderkit.models.folder import ModelFolder
from encoderkit.progress import note
from encoderkit.tasks import TASKS, get_task

__all__ = ["ASKED", "AUTO", "AUTO_HELP", "CPU_CLASSES", "MEASURED", "POLICIES", "RECORD_KEY", "EngineChoice",
           "auto_by_cpu_class", "cpu_class", "embed_rule", "int8_batch_independent", "pick_backend", "recorded",
           "resolve", "serve_choice", "serve_rule"]

AUTO = "auto"
POLICIES = ("graph", "evaluate")  # the compression measurer's and evaluate's rules (not a --backend value)
ASKED = (AUTO, *BACKENDS, STATIC)  # what a --backend may name
RECORD_KEY = "engine"  # where a manifest records the choice its vectors were made with (EngineChoice.to_dict)
# --backend's help (argparse: %%)
AUTO_HELP = ("auto: what `encoderkit doctor` states for this CPU (embed: OpenVINO's static INT8 on an AVX-512 VNNI "
             "CPU without AMX, OpenVINO's bf16/fp32 graph elsewhere, never an engine whose output depends on the "
             "batch; other tasks: INT8 where the card records >= "
             f"{100 * INT8_MIN_AGREEMENT:.1f}%% agreement, else FP32); openvino-int8 calibrates on built-in texts "
             "(index: on its corpus).")


@dataclass(frozen=True)
class EngineChoice:
    """What a model runs on: ``backend`` (a name in :data:`~encoderkit.inference.engines.BACKENDS`, ``static``,
    ``torch int8-dynamic``, or None: the torch model as the task's evaluation loads it); ``calibration``, for
    ``openvino-int8`` only: the texts its activation ranges come from, or the name of the default
    (:data:`~encoderkit.inference.engines.DEFAULT_CALIBRATION`); ``reason``: why."""

    backend: str | None
    calibration: tuple[str, ...] | str | None = None
    reason: str = ""

    @property
    def texts(self) -> list[str] | None:
        """The calibration texts, None for the default (or a backend that takes none)."""
        return list(self.calibration) if isinstance(self.calibration, tuple) else None

    def describe(self) -> str:
        """One line: the backend, why, and what it calibrated on."""
        out = f"{self.backend} ({self.reason})"
        if isinstance(self.calibration, tuple):
            return f"{out}, calibrated on {len(self.calibration)} given texts"
        return f"{out}, calibrated on {self.calibration}" if self.calibration else out

    def to_dict(self) -> dict[str, Any]:
        """The record (JSON): ``{"backend", "calibration": [texts] | name | None, "reason"}``."""
        cal = list(self.calibration) if isinstance(self.calibration, tuple) else self.calibration
        return {"backend": self.backend, "calibration": cal, "reason": self.reason}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> EngineChoice:
        """The choice a :meth:`to_dict` record holds."""
        cal = record.get("calibration")
        if cal is not None and not isinstance(cal, str):
            cal = tuple(str(t) for t in cal)
        return cls(record.get("backend"), cal, str(record.get("reason", "")))


def recorded(record: Mapping[str, Any] | None) -> EngineChoice | None:
    """The choice recorded under :data:`RECORD_KEY` in ``record`` (an index's manifest), None without one."""
    entry = (record or {}).get(RECORD_KEY)
    return EngineChoice.from_dict(entry) if entry else None


def resolve(folder: str | Path | ModelFolder, asked: str | EngineChoice = AUTO,
            built: EngineChoice | Mapping[str, Any] | None = None, *, task: str | None = None,
            hw: Hardware | None = None, calibration: Sequence[str] | None = None,
            update: str | None = None) -> EngineChoice:
    """The engine ``folder`` runs on when ``asked`` (``auto``, a backend, ``graph``/``evaluate``, or a resolved
    choice) and what a build recorded (``built``: an :class:`EngineChoice` or its :meth:`~EngineChoice.to_dict`);
    see the module docstring. ``task``: the head ``evaluate`` measures (default: the folder's). ``hw``: the CPU
    ``auto`` decides for (default: this machine's). ``calibration``: texts an explicit ``openvino-int8``
    calibrates on. ``update``: what is being updated (``index DIR``): an explicit backend other than the build's
    is refused. A choice resolved here from a string is said once on stderr."""
    if isinstance(asked, EngineChoice):
        return asked
    if asked not in ASKED and asked not in POLICIES:
        raise EncoderkitError(f"backend {asked!r} is not one of {', '.join(ASKED)}")
    info = folder if isinstance(folder, ModelFolder) else ModelFolder.open(folder, tokenizer=False)
    if asked in POLICIES:
        backend = pick_backend(info, asked, task)
        return EngineChoice(backend, None, f"the {asked} rule")
    if isinstance(built, Mapping):
        built = EngineChoice.from_dict(built)
    choice = _resolve(info, asked, built, hw, calibration, update)
    note(f"{info.path.name}: engine {choice.describe()}" + (", as built" if choice is built else ""))
    return choice


def _resolve(info: ModelFolder, asked: str, built: EngineChoice | None, hw: Hardware | None,
             calibration: Sequence[str] | None, update: str | None) -> EngineChoice:
    info.require_task(*TASKS)  # a task model, or its export
    if info.static_weights is not None:
        if asked in BACKENDS:
            raise EncoderkitError(f"{info.path} is a static embedding model: it runs on its own table lookup, not "
                                  f"on {asked}; use --backend auto")
        return EngineChoice(STATIC, None, serve_choice(info, hw).why)
    if built is not None and built.backend and asked in (AUTO, built.backend):
        return built  # as recorded (an update records it unchanged)
    if built is not None and built.backend and update:
        raise EncoderkitError(f"{update} was embedded with --backend {built.backend}, this run asks {asked}: the new "
                              f"vectors would come from another engine; pass --backend {built.backend} (or auto), or "
                              "--rebuild to re-embed everything")
    if asked == STATIC:
        raise EncoderkitError(f"{info.path} is not a static embedding model: --backend static runs only those")
    if asked != AUTO:
        cal = None
        if asked == "openvino-int8":
            cal = tuple(str(t) for t in list(calibration)[:CALIBRATION_TEXTS]) if calibration else DEFAULT_CALIBRATION
        return EngineChoice(asked, cal, f"--backend {asked} asked for")
    auto = serve_choice(info, hw)
    if auto.value != "openvino-int8":
        return EngineChoice(auto.value, None, auto.why)
    _, record = engines.openvino_int8_check(info)  # made once per folder, with the graph; kept beside it
    if not record["ok"]:
        return EngineChoice("openvino", None, f"OpenVINO's bf16/fp32 graph: its static INT8 graph was refused for this "
                            f"folder ({engines.describe_fidelity(record)})")
    return EngineChoice("openvino-int8", DEFAULT_CALIBRATION, f"{auto.why}; {engines.describe_fidelity(record)}")


def serve_choice(folder: ModelFolder, hw: Hardware | None = None) -> Choice:
    """What ``--backend auto`` runs ``folder`` on, on ``hw`` (default: this machine), and why: INT8 for a task whose
    object says ``int8_by_default`` (embed): OpenVINO's static INT8 for plain weights on a CPU where it was measured
    ahead (:func:`~encoderkit.inference.engines.openvino_int8_measured`) and OpenVINO is installed, else ONNX
    INT8; for a task whose INT8 agreement is measured, the folder's own INT8 graph where the CPU has VNNI/AMX int8
    and the card's ``int8_agreement`` (:mod:`encoderkit.inference.agreement`) is at least
    :data:`~encoderkit.inference.agreement.INT8_MIN_AGREEMENT`; else ONNX FP32. A folder holding only
    ``model.int8.onnx`` runs on it. Called by :func:`resolve` only."""
    if folder.static_weights is not None:
        return Choice(STATIC, "a static embedding table: a lookup and a mean")
    task = get_task(folder.task)
    if task.int8_by_default:
        if folder.torch_weights is not None and folder.onnx_int8 is None and folder.quantization is None:
            return embed_rule(hw or hardware.detect(), task.name)  # plain weights, no INT8 graph of its own
        if folder.onnx_int8 is not None and int8_batch_independent(folder):
            return Choice("onnx-int8", f"INT8: the folder's own INT8 graph ({PER_ROW})")
        if folder.onnx_int8 is None and folder.torch_weights is not None:  # 8-bit torch weights: exported, then INT8
            return Choice("onnx-int8", f"INT8: the folder's 8-bit weights, exported to an INT8 graph ({PER_ROW})")
        return Choice("onnx-fp32", "FP32: the folder has no INT8 graph that runs batch-independently")
    if folder.onnx_int8 is not None and folder.onnx_fp32 is None and folder.torch_weights is None:
        return Choice("onnx-int8", "INT8: the folder holds only model.int8.onnx"
                      + (f" ({PER_ROW})" if int8_batch_independent(folder) else ""))
    if task.agreement_measure is None:
        return Choice("onnx-fp32", f"FP32: {task.name} runs INT8 only when asked (--backend onnx-int8)")
    hw = hw or hardware.detect()
    if not hw.vnni:
        return Choice("onnx-fp32", "FP32: this CPU has no VNNI/AMX int8")
    ok, why = verdict(folder.card.get(CARD_KEY) if folder.onnx_int8 is not None else None)
    if not ok:
        return Choice("onnx-fp32", f"FP32: {why}")
    if not int8_batch_independent(folder):
        return Choice("onnx-fp32", "FP32: the folder's INT8 graph scales activations per batch and would not run one "
                      "text at a time")
    return Choice("onnx-int8", f"INT8: {why}, and the CPU has {'/'.join(hw.vnni_names())} ({PER_ROW})")


PER_ROW = "run one text at a time: its activation scales come from the text alone, whatever its batch"
CPU_CLASSES = ("AVX2", "AVX-512 VNNI", "AVX-512 BF16", "AMX")  # what doctor and docs/deploy.md state auto's choice for
# auto's embed choice against the best peer (bench/embed_peers.py), per CPU class: the figures of docs/deploy.md's
# tables, named here once so that doctor can state them; a class without a run says so
# what auto measured against the best peer, per CPU class: data, not code (its home is docs/deploy.md's table)
MEASURED: dict[str, str] = {k: v for k, v in json.loads(
    (Path(__file__).with_name("peer_ratios.json")).read_text(encoding="utf-8")).items() if not k.startswith("_")}


def cpu_class(hw: Hardware) -> str:
    """The CPU class of :data:`CPU_CLASSES` ``hw`` falls in (AVX-VNNI without AVX-512, and older CPUs: AVX2)."""
    if hw.amx:
        return "AMX"
    if "avx512_vnni" in hw.isa:
        return "AVX-512 BF16" if "avx512_bf16" in hw.isa else "AVX-512 VNNI"
    return "AVX2"


def int8_batch_independent(folder: ModelFolder) -> bool:
    """Whether ``folder``'s INT8 graph gives a text the same output whatever its batch: a graph with activation
    scales fixed at export, or one that ONNX Runtime's engine runs one text at a time (every dynamic-INT8 graph)."""
    graph = folder.onnx_int8
    return graph is None or engines.ONNX_INT8_PER_ROW or not engines.per_batch_scales(graph)


def embed_rule(hw: Hardware, task: str = "embed") -> Choice:
    """What ``auto`` runs a plain-weights folder of an ``int8_by_default`` task (embed) on, on ``hw``: never an
    engine whose activation scales are per batch. OpenVINO's static INT8 on the CPU class where it was measured ahead
    (:func:`~encoderkit.inference.engines.openvino_int8_measured`), checked against FP32 when its graph is made
    (:func:`resolve`); elsewhere OpenVINO's own graph (bf16 where the CPU has native bf16, else fp32: faithful and
    batch-independent), else ONNX Runtime FP32; where OpenVINO is missing on the measured class, ONNX Runtime's INT8
    one text at a time. The reason names the CPU class and its measured ratio to the best peer (:data:`MEASURED`)."""
    kind = cpu_class(hw)
    measured = f"CPU class {kind}, auto against the best peer: {MEASURED[kind]}, docs/deploy.md"
    if engines.openvino_int8_measured(hw):
        if engines.openvino_ready():
            return Choice("openvino-int8", f"INT8: the {task} task's rule, on OpenVINO's static INT8 (activation "
                          f"scales fixed by calibration: batch-independent); {measured}")
        return Choice("onnx-int8", f"INT8: the {task} task's rule, on ONNX Runtime ({PER_ROW}); OpenVINO's static "
                      f'INT8 is the faster choice here: pip install "encoderkit[openvino]"; {measured}')
    precision = "bf16" if hw.bf16 else "fp32"
    if engines.openvino_installed():
        return Choice("openvino", f"OpenVINO's {precision} graph: faithful and batch-independent (ONNX Runtime's "
                      f"dynamic INT8 scales activations per batch); {measured}")
    return Choice("onnx-fp32", "FP32 on ONNX Runtime: faithful and batch-independent (ONNX Runtime's dynamic INT8 "
                  f'scales activations per batch); OpenVINO is the faster choice: pip install "encoderkit[openvino]"; '
                  f"{measured}")


def auto_by_cpu_class() -> list[tuple[str, Choice]]:
    """What ``auto`` runs a plain embed folder on, and why, for each of :data:`CPU_CLASSES` (with this machine's
    OpenVINO install): what doctor and docs/deploy.md state."""
    isa = {"AVX2": {"avx2"}, "AVX-512 VNNI": {"avx2", "avx512f", "avx512_vnni"},
           "AVX-512 BF16": {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"},
           "AMX": {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}}
    return [(kind, embed_rule(Hardware(kind, frozenset(isa[kind]), 1))) for kind in CPU_CLASSES]


def pick_backend(folder: ModelFolder, policy: str, task: str | None = None) -> str | None:
    """The backend the ``graph`` or ``evaluate`` rule runs ``folder`` on: ``graph``, the folder's INT8 graph when it
    has one, else FP32 (its own, or exported once from its weights); ``evaluate``, the ``graph`` rule when the
    folder has no torch weights, torch's dynamic INT8 model when its weights are 8-bit (``quantize --format
    torch``), else None (the folder's torch model as the task's evaluation loads it). A static folder: ``static``.
    Called by :func:`resolve` only."""
    if folder.static_weights is not None:
        return STATIC
    if policy == "graph":
        return "onnx-int8" if folder.onnx_int8 is not None else "onnx-fp32"
    if folder.torch_weights is None and (folder.onnx_int8 is not None or folder.onnx_fp32 is not None):
        return pick_backend(folder, "graph")
    quant = folder.quantization
    eight_bit = quant is not None and int(quant.get("bits", 8)) == 8
    return TORCH_INT8 if eight_bit and (task or folder.task) in TASKS else None


def serve_rule(hw: Hardware, tasks: tuple[str, ...] = TASKS) -> str:
    """What ``auto`` (:func:`serve_choice`) runs each task on, on ``hw``: what doctor states."""
    int8 = [t for t in tasks if engines.int8_by_default(t)]
    measured = [t for t in tasks if t not in int8 and get_task(t).agreement_measure]
    fp32 = [t for t in tasks if t not in int8 and t not in measured]
    rule = []
    if int8:  # a plain-weights folder: embed_rule; a folder with its own INT8 graph runs it one text at a time
        words = {"openvino-int8": "OpenVINO static INT8", "onnx-int8": "ONNX INT8 one text at a time",
                 "openvino": f"OpenVINO {'bf16' if hw.bf16 else 'fp32'}", "onnx-fp32": "ONNX FP32"}
        rule = [(f"{words[embed_rule(hw).value]} for {', '.join(int8)} (CPU class {cpu_class(hw)}; ONNX INT8 one "
                 "text at a time for a folder with its own INT8 graph)")]
    if measured and hw.vnni:
        rule.append(f"for {', '.join(measured)} ONNX INT8 (one text at a time) where the folder's card records INT8 "
                    f"agreement >= {100 * INT8_MIN_AGREEMENT:.1f}% with FP32 on its dev rows (export --quantize "
                    "int8-dynamic --dev FILE), else ONNX FP32")
    elif measured:
        rule.append(f"ONNX FP32 for {', '.join(measured)} (this CPU has no VNNI/AMX int8)")
    if fp32:
        rule.append(f"ONNX FP32 for {', '.join(fp32)}")
    return "; ".join(rule)
