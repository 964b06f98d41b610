"""Parallel layout of a checkpoint: TP x PP ranks and which global layers each pipeline stage owns."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConvertError
from . import pipeline_layout as pl

SOURCE_LAYOUT = "the source's pipeline_model_parallel_layout"


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int = 1
    pp: int = 1
    first: int | None = None  # layers in the first pipeline stage (uneven PP)
    last: int | None = None  # layers in the last pipeline stage (uneven PP)
    vpp: int | None = None  # virtual pipeline stages (model chunks) per pipeline rank, interleaved
    split: int | None = None  # encoder-decoder models: first decoder stage (pipeline split rank)
    ep: int = 1  # MoE: expert-parallel size (routed experts spread evenly, in order, over EP ranks)
    etp: int | None = None  # MoE: expert-tensor-parallel size of routed experts (None: TP)
    # megatron-core's pipeline_model_parallel_layout string (layer placement per stage; vpp is then
    # its stages / PP, first and last are None); see layout/pipeline_layout.py
    pipeline_layout: str | None = None

    def __str__(self) -> str:
        s = f"TP={self.tp} PP={self.pp}"
        if self.ep != 1 or self.etp not in (None, self.tp):
            s += f" EP={self.ep} ETP={self.expert_tp}"
        if self.vpp:
            s += f" VPP={self.vpp}"
        if self.split is not None:
            s += f" split={self.split}"
        if self.first is not None or self.last is not None:
            s += f" (first={self.first}, last={self.last})"
        if self.pipeline_layout is not None:
            s += f" layout={self.pipeline_layout!r}"
        return s

    @staticmethod
    def from_args(args: object, tp: int, pp: int, encoder_decoder: bool = False, experts: bool = True) -> Layout:
        """The layout Megatron-LM ``args`` describe (pipeline details only with PP > 1; the split rank
        only for encoder-decoder models: Megatron-LM's GPT args may carry an unused one; expert sizes only
        for MoE models: Megatron-LM sets ``expert_tensor_parallel_size`` to TP in every run)."""
        def get(name: str) -> int | None:
            value = getattr(args, name, None) if pp > 1 else None
            return int(value) if value else None
        vpp = get("virtual_pipeline_model_parallel_size")
        ep = int(getattr(args, "expert_model_parallel_size", None) or 1) if experts else 1
        etp = getattr(args, "expert_tensor_parallel_size", None) if experts else None
        text = getattr(args, "pipeline_model_parallel_layout", None)
        if text is None and pp > 1:
            text = hybrid_stages(args)
        if text is not None:  # Megatron-LM derives VPP from the string (validate refuses other flags with it)
            text = str(text)
            vpp = pipeline_vpp(text, pp, SOURCE_LAYOUT)
        return Layout(tp=tp, pp=pp, first=get("decoder_first_pipeline_num_layers"),
                      last=get("decoder_last_pipeline_num_layers"), vpp=vpp if vpp and vpp > 1 else None,
                      split=get("pipeline_model_parallel_split_rank") if encoder_decoder else None,
                      ep=ep, etp=None if etp is None or int(etp) == tp else int(etp), pipeline_layout=text)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def expert_rank(self, expert: int, num_experts: int) -> int:
        """The expert-parallel rank holding global expert ``expert``."""
        return expert // (num_experts // self.ep)

    def experts_of(self, ep_rank: int, num_experts: int) -> range:
        """Global indices of the routed experts expert-parallel rank ``ep_rank`` holds, in local order
        (megatron-core: global = ep_rank * num_local_experts + local)."""
        local = num_experts // self.ep
        return range(ep_rank * local, (ep_rank + 1) * local)

    def validate_experts(self, num_experts: int, expert_ffn: int, shared_ffn: int | None = None,
                         what: str = "target") -> None:
        """Refuse expert layouts megatron-core cannot hold."""
        if self.ep < 1 or self.expert_tp < 1:
            raise ConvertError(f"{what} EP and ETP must be >= 1 (got {self})", "pass positive --target-ep/--target-etp")
        if num_experts % self.ep:
            raise ConvertError(f"{what} EP={self.ep} does not divide num_experts={num_experts}",
                               f"choose --target-ep among the divisors of {num_experts}")
        if expert_ffn % self.expert_tp:
            raise ConvertError(f"{what} ETP={self.expert_tp} does not divide the expert FFN size {expert_ffn}",
                               f"choose --target-etp among the divisors of {expert_ffn}")
        if shared_ffn and shared_ffn % self.tp:
            raise ConvertError(f"{what} TP={self.tp} does not divide the shared-expert FFN size {shared_ffn}",
                               f"choose --target-tp among the divisors of {shared_ffn}")

    @property
    def chunks_per_rank(self) -> int:
        return self.vpp or 1

    def model_chunks(self, num_layers: int) -> list[tuple[int, int, int, int]]:
        """(pp rank, virtual stage, first global layer, layer count) of every model chunk, as
        megatron-core assigns them: with VPP=V, chunk v of rank p starts at v*(L/V) + p*(L/(P*V)); with
        a layout string, each chunk holds its stage's layers, numbered in stage order (VPP-major)."""
        if self.pipeline_layout is not None:
            return pl.stage_layers(self.pipeline_layout, self.pp)
        if not self.vpp:
            return [(p, 0, off, n) for p, (off, n) in
                    enumerate(zip(self.stage_offsets(num_layers), self.stage_sizes(num_layers), strict=True))]
        per = num_layers // (self.pp * self.vpp)
        return [(p, v, v * (num_layers // self.vpp) + p * per, per) for p in range(self.pp) for v in range(self.vpp)]

    def segment_sizes(self, num_layers: int) -> list[int]:
        """The decoder layers of every model chunk in layout-string order (VPP-major: virtual stage 0 of every PP
        rank, then 1, ...), as a HybridModel pattern's ``|`` segments list them (the inverse of ``hybrid_stages``)."""
        return [n for _, _, _, n in sorted(self.model_chunks(num_layers), key=lambda c: (c[1], c[0]))]

    def stages_holding(self, symbol: str) -> list[tuple[int, int]]:
        """(pp rank, virtual stage) of every stage of the layout string holding ``symbol`` (``E``, ``m``, ``L``)."""
        return pl.parse(self.pipeline_layout, self.pp).where(symbol) if self.pipeline_layout is not None else []

    def stack_chunks(self, stacks: list[tuple[str, int]]) -> list[tuple[int, int, str, int, int]]:
        """(pp rank, virtual stage, stack, first layer of the stack, layer count) of every model chunk.

        One stack (GPT's decoder) follows ``model_chunks``. An encoder-decoder model (T5) puts its
        encoder on pipeline stages [0, split) and its decoder on [split, PP), each evenly, as
        Megatron-LM's ``pipeline_model_parallel_split_rank`` does; with PP=1 both are on stage 0.
        Multi-token-prediction layers (stack "mtp") all sit in one chunk: the stage the layout string
        gives them (``m``), else the last one, as megatron-core places them.
        """
        mtp = [(name, n) for name, n in stacks if name == "mtp"]
        stacks = [(name, n) for name, n in stacks if name != "mtp"]
        out = self._stack_chunks(stacks)
        if mtp:
            where = pl.parse(self.pipeline_layout, self.pp).where("m") if self.pipeline_layout is not None else []
            p, v = where[0] if where else (self.pp - 1, self.chunks_per_rank - 1)
            out.append((p, v, "mtp", 0, mtp[0][1]))
            out.sort(key=lambda c: (c[0], c[1]))
        return out

    def _stack_chunks(self, stacks: list[tuple[str, int]]) -> list[tuple[int, int, str, int, int]]:
        if len(stacks) == 1:
            name, n = stacks[0]
            return [(p, v, name, off, count) for p, v, off, count in self.model_chunks(n)]
        (enc, n_enc), (dec, n_dec) = stacks
        if self.pp == 1:
            return [(0, 0, enc, 0, n_enc), (0, 0, dec, 0, n_dec)]
        split = self.split or 0
        per_enc, per_dec = n_enc // split, n_dec // (self.pp - split)
        return ([(p, 0, enc, p * per_enc, per_enc) for p in range(split)]
                + [(p, 0, dec, (p - split) * per_dec, per_dec) for p in range(split, self.pp)])

    def stage_sizes(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage, following megatron-core's uneven-PP rule."""
        if self.pipeline_layout is not None:
            sizes = [0] * self.pp
            for p, _, _, n in self.model_chunks(num_layers):
                sizes[p] += n
            return sizes
        if self.pp == 1:
            return [num_layers]
        if self.vpp:
            return [num_layers // self.pp] * self.pp
        first, last = self.first, self.last
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages):
            raise ConvertError(
                f"{num_layers} layers cannot be split over PP={self.pp} with first={first}, last={last}",
                "choose --target-num-layers-in-first-stage/--target-num-layers-in-last-stage so the "
                "remaining layers divide evenly over the middle stages")
        per = rest // middle_stages if middle_stages else 0
        sizes = [per] * self.pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def stage_offsets(self, num_layers: int) -> list[int]:
        offsets, acc = [], 0
        for n in self.stage_sizes(num_layers):
            offsets.append(acc)
            acc += n
        return offsets

    def stage_of_layer(self, num_layers: int) -> list[int]:
        """The pipeline rank holding each global layer."""
        owner = [0] * num_layers
        for p, _, off, n in self.model_chunks(num_layers):
            owner[off:off + n] = [p] * n
        return owner

    def ranks(self) -> list[tuple[int, int]]:
        """(tp, pp) coordinates of every model-parallel rank, pp-major as Megatron numbers files."""
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]

    def validate(self, num_layers: int, heads: int, groups: int, ffn: int, what: str = "target",
                 encoder_layers: int | None = None, mtp_layers: int = 0) -> None:
        """Refuse layouts megatron-core cannot hold; ``encoder_layers`` is given for encoder-decoder models,
        ``mtp_layers`` for models with multi-token-prediction layers."""
        flag = "--target-tp" if what == "target" else "the source layout"
        if self.tp < 1 or self.pp < 1:
            raise ConvertError(f"{what} TP and PP must be >= 1 (got {self})", "pass positive --target-tp/--target-pp")
        for name, n in (("num_attention_heads", heads), ("ffn_hidden_size", ffn)):
            if n % self.tp:
                raise ConvertError(f"{what} TP={self.tp} does not divide {name}={n}",
                                   f"choose {flag} among the divisors of {n}")
        # megatron-core splits the group-major QKV rows contiguously either way: TP dividing the query groups,
        # or TP a multiple of them (a rank then holds part of one group; attention all-gathers)
        if groups % self.tp and self.tp % groups:
            raise ConvertError(f"{what} TP={self.tp} neither divides num_query_groups={groups} nor is a multiple of it",
                               f"choose {flag} among the divisors or multiples of {groups} that divide the heads")
        if encoder_layers is not None or self.split is not None:
            if self.pipeline_layout is not None:
                raise ConvertError(f"{what} {self}: encoder-decoder models take no pipeline layout string "
                                   "(megatron-core supports none)",
                                   "drop --target-pipeline-layout; use --target-pipeline-split-rank")
            self._validate_split(num_layers, encoder_layers, what)
            return
        if self.pipeline_layout is not None:
            self._validate_string(num_layers, what, mtp_layers)
            return
        if self.pp > num_layers:
            raise ConvertError(f"{what} PP={self.pp} exceeds num_layers={num_layers}",
                               "choose --target-pp <= num_layers")
        if self.vpp is not None:
            if self.vpp < 2 or self.pp < 2:
                raise ConvertError(f"{what} VPP={self.vpp} needs VPP >= 2 and PP >= 2 (got {self})",
                                   "pass --target-vpp >= 2 with --target-pp >= 2, or drop --target-vpp")
            if self.first is not None or self.last is not None:
                raise ConvertError(f"{what} {self} combines virtual pipeline stages with uneven first/last stages",
                                   "drop --target-num-layers-in-first/last-stage or --target-vpp")
            if num_layers % (self.pp * self.vpp):
                raise ConvertError(f"{what} PP={self.pp} x VPP={self.vpp} does not divide num_layers={num_layers}",
                                   "choose --target-pp and --target-vpp whose product divides the layer count")
        sizes = self.stage_sizes(num_layers)
        if any(n <= 0 for n in sizes):
            raise ConvertError(f"{what} pipeline stages {sizes} include an empty stage",
                               "adjust --target-pp or the first/last stage sizes")

    def _validate_string(self, num_layers: int, what: str, mtp_layers: int = 0) -> None:
        """A layout string: what megatron-core accepts, and what the rest of dist_convert can place."""
        flag = pl.FLAG if what == "target" else SOURCE_LAYOUT
        text = self.pipeline_layout
        assert text is not None
        if self.first is not None or self.last is not None:
            raise ConvertError(f"{what} {self} combines a pipeline layout string with uneven first/last stages",
                               f"drop --target-num-layers-in-first/last-stage or {pl.FLAG}")
        layout = pl.parse(text, self.pp, flag)
        pl.check(layout, num_layers, mtp_layers, flag)
        derived = layout.vpp if layout.vpp > 1 else None
        if self.vpp != derived:
            raise ConvertError(f"{what} {self}: the layout string has {len(layout.stages)} stages, VPP={layout.vpp} "
                               f"at PP={self.pp}, not {self.vpp}", f"drop --target-vpp, or fix {flag}")
        if derived is not None and self.pp < 2:
            raise ConvertError(f"{what} pipeline layout {text!r} has {len(layout.stages)} stages at PP=1: virtual "
                               "pipeline stages need PP >= 2", f"pass --target-pp dividing {len(layout.stages)}")
        last = (self.pp - 1, layout.vpp - 1)
        if layout.where("E") != [(0, 0)] or layout.where("L") != [last]:
            # megatron-core allows empty stages before E / after L, yet builds the embedding on the first
            # and the output layer on the last stage: such strings say something the model does not do
            raise ConvertError(f"{what} pipeline layout {text!r} puts E or L on another stage than the first "
                               f"(PP rank 0, virtual stage 0) / last (PP rank {last[0]}, virtual stage {last[1]}); "
                               "that is not supported yet", f"start the first stage with E and end the last with L "
                               f"in {flag}")

    def _validate_split(self, dec_layers: int, enc_layers: int | None, what: str) -> None:
        fix = "--target-pipeline-split-rank" if what == "target" else "the source's pipeline_model_parallel_split_rank"
        if enc_layers is None:
            raise ConvertError(f"{what} {self} sets a pipeline split rank, which only encoder-decoder (T5) models have",
                               "drop --target-pipeline-split-rank")
        if self.vpp is not None or self.first is not None or self.last is not None:
            raise ConvertError(f"{what} {self}: encoder-decoder models take no virtual or uneven pipeline stages",
                               "drop --target-vpp/--target-num-layers-in-first/last-stage; use "
                               "--target-pipeline-split-rank")
        if self.pp == 1:
            if self.split not in (None, 0):
                raise ConvertError(f"{what} pipeline split rank {self.split} needs PP > 1", f"drop {fix}")
            return
        split = self.split
        if split is None or not 0 < split < self.pp:
            raise ConvertError(f"{what} PP={self.pp} of an encoder-decoder model needs a pipeline split rank in "
                               f"[1, {self.pp - 1}] (got {split})",
                               f"pass {fix} (the first decoder stage; encoder stages come before it)")
        if enc_layers % split or dec_layers % (self.pp - split):
            raise ConvertError(f"{what} split rank {split} puts {enc_layers} encoder layers on {split} stages and "
                               f"{dec_layers} decoder layers on {self.pp - split}: not an even split",
                               f"choose {fix} so both stacks divide evenly over their stages")


def hybrid_stages(args: object) -> str | None:
    """The layout string a HybridModel's args pattern gives by its ``|`` segments (megatron-core >= 0.19: each segment
    one pipeline stage, VPP-major; MTP depths after ``/`` on the last); None without ``|``."""
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)
    main, *depths = str(pattern or "").split("/")
    if "|" not in main:
        return None
    legacy = getattr(args, "mtp_hybrid_override_pattern", None)  # megatron-core <= 0.18's one depth pattern
    mtp = len(depths) or (int(getattr(args, "mtp_num_layers", None) or 0) if legacy else 0)
    return pl.of_segments([len(s) for s in main.split("|")], mtp)


def pipeline_vpp(text: str, pp: int, flag: str = pl.FLAG) -> int | None:
    """The VPP size a layout string gives at ``pp`` (stages / PP; None for 1), as Megatron-LM derives it."""
    vpp = pl.parse(text, pp, flag).vpp
    return vpp if vpp > 1 else None
