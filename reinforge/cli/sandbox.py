"""`reinforge sandbox selftest|doctor|build-image`."""

from __future__ import annotations


def register(subparsers) -> None:
    """Add `reinforge sandbox ...` to the `reinforge` parser."""
    p = subparsers.add_parser(
        "sandbox", help="rootless Podman sandboxes: selftest, doctor, build-image"
    )
    sub = p.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("selftest", help="run the hostile suite against this machine's set-up")
    s.add_argument("--json", action="store_true", help="print one JSON report")
    s.set_defaults(func=_selftest)
    d = sub.add_parser("doctor", help="say what is missing for sandboxes and how to fix it")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_doctor)
    b = sub.add_parser("build-image", help="build (or reuse) the default Python sandbox image")
    b.add_argument("--image", default=None, help="image reference (default: the sandbox default)")
    b.add_argument(
        "--offline", action="store_true", help="don't try a registry; build with debootstrap"
    )
    b.set_defaults(func=_build_image)


def _selftest(args) -> int:
    from reinforge.cli import UserError
    from reinforge.envs.sandbox.box import SandboxInfraError, connect
    from reinforge.envs.sandbox.selftest import main_selftest

    try:
        connect().close()
    except SandboxInfraError as exc:
        raise UserError(f"{exc} (see `reinforge sandbox doctor`)") from exc
    return main_selftest(args.json)


def _doctor(args) -> int:
    import msgspec

    from reinforge.envs.sandbox.image import doctor

    checks = doctor()
    if args.json:
        print(msgspec.json.encode(checks).decode())
    else:
        for c in checks:
            print(
                f"{'ok ' if c.ok else 'BAD'} {c.name:<16} {c.detail}"
                + (f"\n    fix: {c.fix}" if c.fix else "")
            )
    return 0 if all(c.ok for c in checks) else 1


def _build_image(args) -> int:
    from reinforge.cli import UserError
    from reinforge.envs.sandbox.box import DEFAULT_IMAGE, SandboxInfraError
    from reinforge.envs.sandbox.image import build_image

    try:
        print(build_image(args.image or DEFAULT_IMAGE, offline=args.offline))
    except SandboxInfraError as exc:
        raise UserError(str(exc)) from exc
    return 0
