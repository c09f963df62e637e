"""``pdproto check``: the topology verdict and deployment findings for one prefill/decode pair.

Each side comes from flags (``--prefill-dcp 1 --decode-dcp 4 ...``, built with
``pdproto.negotiation.topology.example_*``) or from a protobuf-JSON file (``--prefill-json`` holds a
``PrefillServerInfo``, ``--decode-json`` a ``KvRegistration``). Exit status: 0 when the
pair is accepted with no error finding, 1 when the topology is rejected or a finding
is an error, 2 when the input itself is malformed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from pdproto import backends, v1
from pdproto.negotiation.config import (SGLANG_ONLY_DCP_BACKENDS, CacheMode, DeploymentConfig, Finding, Role, Severity,
                             check_deployment)
from pdproto.errors import InvalidFieldError
from pdproto.negotiation.topology import (
    Decision,
    Rejection,
    example_registration,
    example_server_info,
    negotiate,
)

_ATTENTION: dict[str, int] = {"mla": v1.ATTENTION_KIND_MLA, "hybrid_mla": v1.ATTENTION_KIND_HYBRID_MLA,
              "mha": v1.ATTENTION_KIND_MHA}
_ATTENTION_NAME: dict[int, str] = {v: k for k, v in _ATTENTION.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the check subcommand's options."""
    g = parser.add_argument_group("both sides")
    g.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    g.add_argument("--draft", type=int, default=0, help="draft (speculative) entries (default 0)")
    g.add_argument("--layer-ids", action="store_true", help="both pools send per-entry layer ids")
    g.add_argument("--attention", choices=sorted(_ATTENTION), default="mla",
                   help="KV pool family (default mla)")
    g.add_argument("--dtype", default="bfloat16", help="KV cache dtype (default bfloat16)")
    g.add_argument("--token-bytes", type=int, default=1152,
                   help="bytes of one token row per layer (default 1152: MLA 576 x bf16)")
    g.add_argument("--page-size", type=int, default=16, help="page size of both sides (default 16)")
    g.add_argument("--backend", choices=(*backends.NAMES, *sorted(SGLANG_ONLY_DCP_BACKENDS)),
                   default="mooncake", help="transfer backend (default mooncake)")
    g.add_argument("--model", default="", help="model id of both sides (default: unchecked)")
    g.add_argument("--allocation-policy", default="early", help="early or prefill_complete")
    g.add_argument("--role-switch", action="store_true", help="--enable-pd-role-switch on both")
    for side in ("prefill", "decode"):
        s = parser.add_argument_group(side)
        s.add_argument(f"--{side}-json", type=Path, metavar="FILE",
                       help=f"{'PrefillServerInfo' if side == 'prefill' else 'KvRegistration'}"
                       " in protobuf JSON; overrides the topology flags of this side")
        s.add_argument(f"--{side}-dcp", type=int, metavar="N", default=1, help="DCP size (default 1)")
        s.add_argument(f"--{side}-dcp-rank", type=int, metavar="R", default=0, help="DCP rank (default 0)")
        s.add_argument(f"--{side}-page-size", type=int, default=None, metavar="N",
                       help="page size (default --page-size)")
        s.add_argument(f"--{side}-pp", type=int, metavar="N", default=1, help="PP size (default 1)")
        s.add_argument(f"--{side}-pp-rank", type=int, metavar="R", default=0, help="PP rank (default 0)")
        s.add_argument(f"--{side}-tp", type=int, metavar="N", default=1, help="attention TP size (default 1)")
        s.add_argument(f"--{side}-tp-rank", type=int, metavar="R", default=0, help="attention TP rank (default 0)")
        s.add_argument(f"--{side}-dtype", default=None, metavar="DTYPE", help="KV dtype (default --dtype)")
        s.add_argument(f"--{side}-token-bytes", type=int, default=None, metavar="B",
                       help="row bytes (default --token-bytes)")
        s.add_argument(f"--{side}-cache", choices=[c.value for c in CacheMode], default=None,
                       help="prefix cache (default: radix; a DCP decode is forced to chunk)")
    parser.add_argument("--prefill-cp", type=int, default=1, help="prefill attention CP (default 1)")
    parser.add_argument("--kv-sharding", action="store_true", help="prefill KV cache sharding")
    parser.add_argument("--radix-page-size", type=int, default=None, help="prefill radix/allocator page")
    parser.add_argument("--speculative", default=None, help="speculative algorithm (e.g. eagle)")
    parser.add_argument("--retraction-backup", default=None, help="decode retraction backup (e.g. host_pool)")
    parser.add_argument("--unified-memory", action="store_true", help="decode unified memory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _load(path: Path, message: Any) -> Any:
    """Parse a protobuf-JSON file into ``message``; errors become InvalidFieldError."""
    try:
        return json_format.Parse(path.read_text(), message)
    except (OSError, json_format.ParseError) as exc:
        raise InvalidFieldError(str(path), f"cannot read {path}: {exc}") from exc


def _side(args: argparse.Namespace, side: str, name: str) -> Any:
    """One side's flag value, with the shared flag as its default."""
    value = getattr(args, f"{side}_{name}")
    return getattr(args, name) if value is None else value


def _messages(args: argparse.Namespace) -> tuple[v1.PrefillServerInfo, v1.KvRegistration]:
    """The pair to negotiate, from JSON files or flags."""
    common: dict[str, Any] = {
        "num_layers": args.layers, "num_draft": args.draft, "layer_ids": args.layer_ids,
        "attention": _ATTENTION[args.attention], "model_id": args.model,
    }

    def topo(side: str) -> dict[str, Any]:
        return {**common,
                "dcp_size": getattr(args, f"{side}_dcp"), "dcp_rank": getattr(args, f"{side}_dcp_rank"),
                "pp_size": getattr(args, f"{side}_pp"), "pp_rank": getattr(args, f"{side}_pp_rank"),
                "tp_size": getattr(args, f"{side}_tp"), "tp_rank": getattr(args, f"{side}_tp_rank"),
                "page_size": _side(args, side, "page_size"), "dtype": _side(args, side, "dtype"),
                "token_bytes": _side(args, side, "token_bytes")}

    if args.prefill_json is not None:
        info = _load(args.prefill_json, v1.PrefillServerInfo())
    else:
        info = example_server_info(**topo("prefill"), cp_size=args.prefill_cp,
                                   kv_sharding=args.kv_sharding, backends=[b.enum for b in backends.ALL])
    if args.decode_json is not None:
        reg = _load(args.decode_json, v1.KvRegistration())
    else:
        # SGLang-only names (mori, ascend, fake) have no pdproto engine: an unset transport.
        known = args.backend in backends.NAMES
        reg = example_registration(**topo("decode"),
                                   backend=backends.by_name(args.backend).enum if known else v1.BACKEND_UNSPECIFIED)
    return info, reg


def _configs(args: argparse.Namespace, info: v1.PrefillServerInfo,
             reg: v1.KvRegistration) -> list[DeploymentConfig]:
    """Both servers' deployment settings; topology fields come from the messages."""
    spec = backends.of_registration(reg)
    backend = args.backend if spec is None else spec.name
    shared: dict[str, Any] = {"backend": backend, "allocation_policy": args.allocation_policy,
                              "role_switch": args.role_switch}

    def cache(side: str) -> CacheMode | None:
        value = getattr(args, f"{side}_cache")
        return None if value is None else CacheMode(value)

    prefill = DeploymentConfig(
        role=Role.PREFILL, dcp_size=info.dcp.size or 1, page_size=info.page_size or 1,
        cache=cache("prefill"), radix_page_size=args.radix_page_size,
        attention=_ATTENTION_NAME.get(info.attention_kind), pp_size=info.pp.size or 1,
        attn_cp_size=info.attn_cp.size or 1, kv_cache_sharding=info.enable_kv_cache_sharding,
        speculative_algorithm=args.speculative, **shared)
    decode = DeploymentConfig(
        role=Role.DECODE, dcp_size=reg.dcp.size or 1, page_size=reg.page_size or 1,
        cache=cache("decode"), attention=_ATTENTION_NAME.get(reg.attention_kind),
        pp_size=reg.pp.size or 1, retraction_backup=args.retraction_backup,
        unified_memory=args.unified_memory, **shared)
    return [prefill, decode]


def _finding_json(role: Role, f: Finding) -> dict[str, str]:
    return {"role": role.value, "severity": f.severity.value, "code": f.code,
            "reason": f.reason.code, "message": f.message}


def _print_table(result: Decision | Rejection, findings: list[tuple[Role, Finding]]) -> None:
    """Human-readable report."""
    if isinstance(result, Rejection):
        print(f"topology: REJECTED  {result.reason.code}")
        print(f"  {result.message}")
        for key, value in sorted(result.metadata.items()):
            print(f"  {key} = {value}")
    else:
        d = result
        print(f"topology: ACCEPTED  mode={d.mode.name}  backend={backends.by_enum(d.backend).name}"
              f"  version={d.version[0]}.{d.version[1]}")
        print(f"  prefill DCP size {d.src.dcp_size} rank {d.src.dcp_rank}, page {d.src.page_size}"
              f"  ->  decode DCP size {d.dst.dcp_size} rank {d.dst.dcp_rank}, page {d.dst.page_size}")
        print(f"  {'src':>4} {'dst':>4}  {'role':<7}{'src B/tok':>10}{'dst B/tok':>10}")
        for p in d.pairings:
            print(f"  {p.src_entry:>4} {p.dst_entry:>4}  {p.role.name.lower():<7}"
                  f"{p.src_token_bytes:>10}{p.dst_token_bytes:>10}")
    print(f"deployment: {len(findings)} finding(s)")
    for role, f in findings:
        print(f"  {f.severity.value:<8}{role.value:<9}{f.code}: {f.message}")


def run(args: argparse.Namespace) -> int:
    """Negotiate the pair, check both deployments, print, and return the exit status."""
    try:
        info, reg = _messages(args)
        result = negotiate(info, reg)
    except (InvalidFieldError, ValueError) as exc:
        field = getattr(exc, "field", "")
        if args.json:
            print(json.dumps({"ok": False, "error": {"field": field, "message": str(exc)}}, indent=2))
        else:
            print(f"pdproto check: invalid input{f' ({field})' if field else ''}: {exc}", file=sys.stderr)
        return 2
    findings = [(cfg.role, f) for cfg in _configs(args, info, reg) for f in check_deployment(cfg)]
    ok = isinstance(result, Decision) and not any(f.severity is Severity.ERROR for _, f in findings)
    if args.json:
        topology = json_format.MessageToDict(result.to_proto(), preserving_proto_field_name=True)
        print(json.dumps({"ok": ok, "topology": topology,
                          "findings": [_finding_json(r, f) for r, f in findings]}, indent=2))
    else:
        _print_table(result, findings)
    if isinstance(result, Rejection):
        print(f"pdproto check: rejected: {result.reason.code}: {result.message}", file=sys.stderr)
    for role, f in findings:
        if f.severity is Severity.ERROR:
            print(f"pdproto check: {role.value} {f.code}: {f.message}", file=sys.stderr)
    return 0 if ok else 1
