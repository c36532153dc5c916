#!/usr/bin/env python3
"""Speculative expert prefetch: how well layer L's hidden state, put through layer L+1's router, predicts the experts
layer L+1 then chooses, and what a prefetch of the predicted misses would save in decode from a device expert cache.

  python bench/prefetch_accuracy.py MODEL.gguf [MODEL ...] [-p 32] [-n 256] [--json] [--out DIR]
  python bench/prefetch_accuracy.py --synth small:locality --synth small:natural --synth small:skewed

Each model decodes a prompt, then -n tokens one by one (pyllama_pp.trace.record, the trace worker job, on the CPU),
recording each MoE layer's expert ids and the hidden states llama's eval callback names: "ffn_inp-L" (the residual
after layer L's attention, the input of L's FFN norm: known when L's router runs, so the copies could start while
L's experts compute), "l_out-L" (the residual after layer L: known only after L's experts) and "ffn_norm-L" (the
router's real input). In numpy, with the weights read by gguf-py (dequantized where quantized):

  predicted(L+1) = top-w of router_{L+1}(rms_norm(h_L) * ffn_norm_{L+1}.weight)   (+ the router's biases)

that is layer L+1's own FFN norm applied to layer L's residual: the real input of L+1's router is the same norm of
the residual *after L+1's attention* (ffn_inp-(L+1)), which the prediction cannot see. The source "exact" applies
router_{L+1} to the captured ffn_norm-(L+1): it must give the actual ids (recall 1.0) and checks the arithmetic.

Reported per model and source, over the decode tokens (after the cache simulator's warm-up) and the MoE layers that
have a layer before them: the recall of the actual top-k (the share of actual experts among the predicted); for a
per-layer LRU cache of each --fractions size (pyllama_pp.expert_cache_sim.cached_before on the actual ids, without
the prefetch's own insertions), the share of its misses that the prediction names, the predicted experts neither
used nor cached (wasted fetches) per token, and the gain model's decode speed-up (--t-dev-ms, --link-gbps,
--expert-mb: by default the H100 case of docs/RESULTS.md; see `gain`).

Nothing is written without --out (then results.md and results.json go there). A bad input (a missing model, a file
that is not a GGUF, an --out whose parent is missing) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import _common as C
import numpy as np

from pyllama_pp import synth
from pyllama_pp import trace as tracing
from pyllama_pp.errors import PyllamaError
from pyllama_pp.expert_cache_sim import cached_before, default_warmup
from pyllama_pp.expert_trace import ExpertTrace
from pyllama_pp.model_file import check_model_path
from pyllama_pp.planning import models_dir

SOURCES = ("exact", "ffn_inp", "l_out")   # the hidden state each prediction reads (module docstring)
CAPTURE = ("ffn_inp", "l_out", "ffn_norm")
FRACTIONS = (0.125, 0.25)
# the H100 case (docs/RESULTS.md, "What a user gets without switches", the 16-layer 30B-A3B-shaped model): a MoE
# layer from the slots at full hits 0.088 ms (the decode probe), the pinned link ~55 GB/s, an expert of the
# qwen3-30b-a3b preset (gate, up, down in q8_0) 5.01 MB: 16 slots (12.5%) hit 66% and decode at 179-186 t/s
H100 = {"t_dev_ms": 0.088, "link_gbps": 55.0, "expert_mb": 5.0135}


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.parts[f.data[0]].tolist()


class Router:
    """Each layer's router (ffn_gate_inp), its biases and the FFN norm before it, read from a GGUF with gguf-py.

    Args:
        path: the model.
    Raises:
        ValueError: for a model without routers.
    """

    def __init__(self, path):
        import gguf   # (late: only this tool reads weights)
        r = gguf.GGUFReader(str(path))
        arch = bytes(_field(r, "general.architecture")).decode()
        self.n_expert = int(_field(r, f"{arch}.expert_count")[0])
        self.k = int(_field(r, f"{arch}.expert_used_count")[0])
        eps = _field(r, f"{arch}.attention.layer_norm_rms_epsilon")
        self.eps = float(eps[0]) if eps else 1e-6
        gating = _field(r, f"{arch}.expert_gating_func")
        self.sigmoid = bool(gating) and int(gating[0]) == 2   # (llama.cpp: 1 softmax, 2 sigmoid)
        tensors = {t.name: t for t in r.tensors}

        def value(name: str) -> Optional[np.ndarray]:
            t = tensors.get(name)
            if t is None:
                return None
            data = np.asarray(t.data)
            if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                data = gguf.quants.dequantize(data, t.tensor_type)
            return data.astype(np.float32).reshape([int(n) for n in reversed(t.shape)])

        self.w, self.b, self.sel_b, self.norm = {}, {}, {}, {}
        for name in tensors:
            if not (name.startswith("blk.") and name.endswith(".ffn_gate_inp.weight")):
                continue
            il = int(name.split(".")[1])
            self.w[il] = value(name)   # [n_expert, n_embd]
            self.b[il] = value(f"blk.{il}.ffn_gate_inp.bias")
            self.sel_b[il] = value(f"blk.{il}.exp_probs_b.bias")
            norm = value(f"blk.{il}.ffn_norm.weight")
            self.norm[il] = norm if norm is not None else value(f"blk.{il}.post_attention_norm.weight")
        if not self.w:
            raise ValueError(f"{Path(path).name} has no router (ffn_gate_inp): not a MoE model")

    def select(self, layer: int, x: np.ndarray, width: int, normed: bool = False) -> np.ndarray:
        """The `width` experts of highest selection score of `layer` for inputs x, best first.

        Args:
            layer: the model's layer index (a MoE layer).
            x: float [tokens, n_embd]: the residual (normed here with the layer's FFN norm), or the normed input.
            width: how many to name.
            normed: x is the router's input already (no norm applied).
        Returns:
            np.ndarray: int [tokens, width].
        """
        x = np.asarray(x, dtype=np.float64)
        if not normed:
            x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + self.eps)
            if self.norm[layer] is not None:
                x = x * self.norm[layer]
        logits = x @ self.w[layer].T.astype(np.float64)
        if self.b[layer] is not None:
            logits = logits + self.b[layer]
        score = logits
        if self.sel_b[layer] is not None:   # selection by (sigmoid or softmax) probabilities plus the bias
            if self.sigmoid:
                probs = 1.0 / (1.0 + np.exp(-logits))
            else:
                probs = np.exp(logits - logits.max(axis=1, keepdims=True))
                probs /= probs.sum(axis=1, keepdims=True)
            score = probs + self.sel_b[layer]
        return np.argsort(-score, axis=1, kind="stable")[:, :width]


def predictions(tr: ExpertTrace, router: Router, source: str, width: int) -> np.ndarray:
    """Each token's predicted experts of each MoE layer column, best first; -1 where there is no prediction (the
    first layer, a layer whose predecessor's state was not captured).

    Args:
        tr: a trace with `tensors` (trace.record(capture=CAPTURE)).
        router: the model's routers.
        source: one of SOURCES.
        width: experts named per prediction.
    Returns:
        np.ndarray: int [tokens, MoE layers, width].
    Raises:
        ValueError: for an unknown source or a trace without its tensor.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; sources: {', '.join(SOURCES)}")
    name = "ffn_norm" if source == "exact" else source
    if name not in tr.tensors:
        raise ValueError(f"the trace did not capture {name!r} (captured: {sorted(tr.tensors) or 'nothing'})")
    h = tr.tensors[name]
    out = np.full((tr.n_tokens, len(tr.layers), width), -1, dtype=np.int32)
    for c, layer in enumerate(int(x) for x in tr.layers):
        src = layer if source == "exact" else layer - 1
        if src < 0 or np.isnan(h[:, src]).any():
            continue
        out[:, c] = router.select(layer, h[:, src], width, normed=source == "exact")
    return out


def saved_experts(order: Sequence[int], actual: set, cached: np.ndarray, window: float) -> float:
    """Expert copies (in units of one expert's link time) a prefetch saves at one layer for one token: the predicted
    experts not cached are copied best first during the window (link time beside the previous layer's device time);
    a right one done in time saves its copy, a right one still in flight the part done; a wrong one still in flight
    delays the real misses by its rest (it is let finish).

    Args:
        order: the predicted experts, best first.
        actual: the experts the layer then used.
        cached: bool [n_expert]: in the cache at the token's start.
        window: the link time free for the prefetch, in experts' copy times.
    Returns:
        float: the copies saved (negative where a wrong copy spills past the window).
    """
    saved, t = 0.0, 0.0
    for e in order:
        if t >= window:
            break
        if cached[e]:
            continue
        done = min(1.0, window - t)
        saved += done if e in actual else -(1.0 - done)
        t += 1.0
    return saved


@dataclass
class Gain:
    """The decode gain model: a MoE layer of a cached decode costs t_dev (its device time at full hits: attention,
    router, the ids readback, the experts from the slots) plus its misses' copies, in series (DESIGN.md); the
    prefetch copies the predicted misses of the next layer while the link would idle, i.e. beside one layer's t_dev.

    Attributes:
        t_dev_ms: a MoE layer's device time at full hits.
        link_gbps: the link's rate.
        expert_mb: one expert's bytes (its gate, up and down), MB.
    """

    t_dev_ms: float
    link_gbps: float
    expert_mb: float

    @property
    def t_expert_ms(self) -> float:
        """One expert's copy over the link."""
        return self.expert_mb / self.link_gbps

    @property
    def window(self) -> float:
        """The link time beside one layer's device time, in expert copies."""
        return self.t_dev_ms / self.t_expert_ms

    def speedup(self, misses: float, saved: float) -> float:
        """Decode speed-up of the prefetch for a mean of `misses` and `saved` copies a layer.

        Args:
            misses: the cache's misses per layer and token.
            saved: the copies the prefetch saves per layer and token.
        Returns:
            float: t/s with the prefetch over t/s without.
        """
        serial = self.t_dev_ms + misses * self.t_expert_ms
        return serial / (serial - saved * self.t_expert_ms)


def evaluate(tr: ExpertTrace, pred: np.ndarray, k: int, fractions: Sequence[float], gain: Gain,
             cols: Optional[Sequence[int]] = None) -> dict:
    """The prediction's accuracy over the decode tokens after the warm-up, and at each cache size what it would
    have fetched (module docstring).

    Args:
        tr: the trace (actual ids).
        pred: predictions(): [tokens, MoE layers, width], -1 where none.
        k: experts used per token and layer.
        fractions: cache sizes, fractions of a layer's experts.
        gain: the gain model's costs.
        cols: the MoE layer columns counted (default: every one with a prediction).
    Returns:
        dict: tokens, layer_pairs, recall, recall_per_layer, and per fraction hit rate, misses per layer-token, the
            share of misses predicted, wasted fetches per token, saved copies per layer-token, the speed-up, and
            the speed-up of a perfect prediction.
    """
    t0 = max(tr.n_prompt, default_warmup(tr))
    cols = [c for c in (range(len(tr.layers)) if cols is None else cols) if (pred[:, c] >= 0).all()]
    tokens = range(t0, tr.n_tokens)
    n_tok = len(tokens)
    out: dict = {"tokens": n_tok, "layer_pairs": len(cols)}
    if not cols or not n_tok:
        return out
    topk = pred[:, :, :k]
    per_layer = {}
    for c in cols:
        hit = [len(set(topk[t, c]) & set(tr.ids[t, c])) for t in tokens]
        per_layer[int(tr.layers[c])] = float(np.mean(hit)) / k
    out["recall"] = float(np.mean(list(per_layer.values())))
    out["recall_per_layer"] = per_layer
    for f in fractions:
        cached = cached_before(tr, f)
        looked = miss = named = wasted = 0
        saved = perfect = 0.0
        for t in tokens:
            for c in cols:
                actual = set(int(e) for e in tr.ids[t, c])
                miss_set = {e for e in actual if not cached[t, c, e]}
                predicted = [int(e) for e in pred[t, c]]
                looked += len(actual)
                miss += len(miss_set)
                named += len(miss_set & set(predicted))
                wasted += sum(1 for e in predicted if e not in actual and not cached[t, c, e])
                saved += saved_experts(predicted, actual, cached[t, c], gain.window)
                perfect += min(len(miss_set), gain.window)
        n = n_tok * len(cols)
        out[f"{f:g}"] = {"hit_rate": 1 - miss / looked, "misses_per_layer": miss / n,
                         "misses_predicted": named / miss if miss else float("nan"), "wasted_per_token": wasted / n_tok,
                         "saved_per_layer": saved / n, "speedup": gain.speedup(miss / n, saved / n),
                         "speedup_perfect": gain.speedup(miss / n, perfect / n)}
    return out


def synth_model(spec: str) -> tuple[str, Path]:
    """(label, path) of PRESET:ROUTING, written once into the model cache."""
    preset, _, routing = spec.partition(":")
    return spec, synth.cached_model(models_dir(), preset, **({"routing": routing} if routing else {}))


def run(args) -> dict:
    """Trace each model, predict, evaluate; errors go up to main."""
    sources = [(Path(m).name, Path(m)) for m in args.models]
    for label, path in sources:   # (before any worker starts)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such model file (a GGUF)")
        check_model_path(path)
    if args.out is not None and not args.out.parent.is_dir():
        raise FileNotFoundError(f"cannot write into {args.out}: its parent folder {args.out.parent} does not exist")
    sources += [synth_model(s) for s in args.synth]
    if not sources:
        raise ValueError("give a model (GGUF) or --synth PRESET:ROUTING")
    gain = Gain(args.t_dev_ms, args.link_gbps, args.expert_mb)
    rows = []
    for label, path in sources:
        t0 = time.time()
        tr = tracing.record(path, n_prompt=args.prompt, n_decode=args.tokens, seed=args.seed, capture=CAPTURE)
        router = Router(path)
        width = args.width or router.k
        preds = {source: predictions(tr, router, source, width) for source in SOURCES}
        cols = [c for c in range(len(tr.layers)) if all((p[:, c] >= 0).all() for p in preds.values())]
        for source, pred in preds.items():   # (every source on the same layers: those with one before them)
            res = evaluate(tr, pred, router.k, args.fractions, gain, cols)
            rows.append({"model": label, "routing": tr.meta.get("routing"), "source": source, "width": width,
                         "k": router.k, "n_expert": router.n_expert, **res})
        if not args.json:
            print(f"{label}: traced and evaluated in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"command": C.command_line(), "machine": C.machine(), "gain_inputs": gain.__dict__ | {
        "t_expert_ms": gain.t_expert_ms, "window_experts": gain.window}, "prompt": args.prompt, "tokens": args.tokens,
        "seed": args.seed, "rows": rows}


def table(doc: dict, fractions: Sequence[float]) -> str:
    """The rows as Markdown."""
    head = ["model", "source", "recall"]
    for f in fractions:
        head += [f"LRU {f:.1%}: hits", "misses predicted", "wasted / token", "speed-up (perfect)"]
    lines = []
    for r in doc["rows"]:
        cells = [r["model"], r["source"], C.num(r.get("recall"), "{:.1%}")]
        for f in fractions:
            x = r.get(f"{f:g}", {})
            cells += [C.num(x.get("hit_rate"), "{:.1%}"), C.num(x.get("misses_predicted"), "{:.1%}"),
                      C.num(x.get("wasted_per_token"), "{:.1f}"),
                      f"{x['speedup']:.3f}x ({x['speedup_perfect']:.3f}x)" if x else "-"]
        lines.append(cells)
    g = doc["gain_inputs"]
    return (C.md_table(head, lines, "ll" + "r" * (len(head) - 2))
            + f"\nGain model: t_dev {g['t_dev_ms']} ms a layer, link {g['link_gbps']} GB/s, an expert "
              f"{g['expert_mb']} MB ({g['t_expert_ms'] * 1000:.0f} us), window {g['window_experts']:.2f} experts.\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="GGUF MoE models")
    ap.add_argument("--synth", action="append", default=[], metavar="PRESET:ROUTING",
                    help="a synthetic model (written once into the model cache), e.g. small:locality; repeatable")
    ap.add_argument("-p", "--prompt", type=int, default=32, help="prompt tokens (default %(default)s)")
    ap.add_argument("-n", "--tokens", type=int, default=256, help="tokens decoded one by one (default %(default)s)")
    C.add_trace_options(ap, FRACTIONS)
    ap.add_argument("--width", type=int, default=0, help="experts predicted (default: the model's k)")
    ap.add_argument("--t-dev-ms", type=float, default=H100["t_dev_ms"],
                    help="a MoE layer's device time at full hits (default: the H100's %(default)s)")
    ap.add_argument("--link-gbps", type=float, default=H100["link_gbps"], help="the link (default %(default)s)")
    ap.add_argument("--expert-mb", type=float, default=H100["expert_mb"],
                    help="an expert's bytes, MB (default: the 30B-A3B preset's %(default)s)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--out", type=Path, default=None, help="write results.md and results.json here (made)")
    args = ap.parse_args(argv)
    try:
        doc = run(args)
    except (PyllamaError, ValueError, OSError) as e:   # (one line: what is wrong; no traceback)
        kind = getattr(e, "error_type", None) or type(e).__name__
        print(f"prefetch_accuracy.py: error: {kind}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    md = table(doc, args.fractions)
    if args.out is not None:
        args.out.mkdir(exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
        m = doc["machine"]
        machine = f"{m['nproc']}-core {m['cpu']} ({m['host']}), {m['date_utc']}"
        (args.out / "results.md").write_text(f"- command: `{doc['command']}`\n- machine: {machine}\n\n{md}")
    print(json.dumps(doc, default=float) if args.json else md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
