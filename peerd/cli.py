"""The `peerd` command: init a run config, start a peer, ask a peer for its status, run a local demo swarm, and
manage admission keys (peer key, owner key, invitations)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

from peerd.allocator import tune_allocator
from peerd.config import ConfigError, RunConfig
from peerd.config_template import write_template
from peerd.errors import UserError, report, unexpected


def main(argv: list[str] | None = None) -> int:
    tune_allocator()  # before any thread starts: see peerd/allocator.py
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks (and debug logs) instead of one line")
    parser = argparse.ArgumentParser(prog="peerd", description=__doc__, parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser

    def sub_parser(name: str, **kw: object) -> argparse.ArgumentParser:
        return add_parser(name, parents=[common], **kw)  # type: ignore[arg-type]

    sub.add_parser = sub_parser  # type: ignore[method-assign]

    p = sub.add_parser("init", help="write a commented run config with defaults")
    p.add_argument("path", help="where to write it, e.g. run.toml")

    p = sub.add_parser(
        "ensemble-eval", help="per-domain perplexity of domain experts, their mixture, and a same-compute baseline"
    )
    # defined here, not in peerd/ensemble_eval.py: that module imports torch, which every `peerd` command (status,
    # init) would then pay for (1.8 s idle, several seconds on a loaded host) just to build the parser
    p.add_argument("--expert", action="append", required=True, help="an expert's data dir or checkpoint (repeat)")
    p.add_argument("--data", action="append", required=True, help="DOMAIN=PATH of held-out text (repeat; PATH '' "
                   "or 'stdlib': the Python standard library's sources)")  # fmt: skip
    p.add_argument("--baseline", help="data dir or checkpoint of one model trained on all domains (same compute)")
    p.add_argument("--batches", type=int, default=8, help="held-out batches per domain")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("start", help="run one peer in the foreground until SIGINT/SIGTERM")
    p.add_argument("--config", required=True, help="run config (see `peerd init`)")
    p.add_argument("--listen", default="0.0.0.0:7000", help="gRPC listen address (port 0 picks a free one)")
    p.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        help="HOST:PORT (certificate trusted on first use) or PEERID@HOST:PORT (pinned) of any peer (repeatable)",
    )
    p.add_argument("--announce", help="address other peers should dial, if not the listen address")
    p.add_argument("--data-dir", default="peerd-data", help="identity key, checkpoints and address files")
    p.add_argument("--metrics", help="serve Prometheus metrics and HTTP SD on HOST:PORT")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--shard", type=int, help="data shard to read (default: derived from the peer id)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--insecure", action="store_true", help="plaintext gRPC (tests only)")
    p.add_argument("--join-secret-file", help="admission mode 'secret': the shared secret (overrides [security])")
    p.add_argument("--invite-file", help="admission mode 'invite': this peer's invitation (overrides [security])")
    p.add_argument("--wait-peers", type=int, default=0, help="wait until this many peers are up before training")
    p.add_argument(
        "--join-timeout",
        type=float,
        help="seconds to retry bootstrap addresses where nothing answers (default: [network] join_timeout, 60)",
    )
    p.add_argument(
        "--init-from",
        help="start from these weights (a peerd checkpoint.pt or a .safetensors state dict) instead of the seed's; "
        "every peer passes the same file (its sha256 is run.init_digest, part of the run id)",
    )
    p.add_argument(
        "--procs-per-peer",
        type=int,
        default=1,
        help="run this peer as N local processes (one per GPU; gloo on CPU): data-parallel ranks, one talks to the "
        "swarm (or start every rank with torchrun instead)",
    )
    p.add_argument("--log-level", default="INFO")

    p = sub.add_parser("status", help="print one peer's view of the run")
    p.add_argument("address", help="HOST:PORT (or PEERID@HOST:PORT) of the peer")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--insecure", action="store_true", help="the peer runs --insecure (plaintext)")
    p.add_argument("--data-dir", help="sign the request with this peer's key: admitted peers see the peer list")
    p.add_argument("--join-secret-file", help="with --data-dir, in admission mode 'secret'")
    p.add_argument("--invite-file", help="with --data-dir, in admission mode 'invite'")

    p = sub.add_parser("key", help="print a peer's public key and id (creating its identity if needed)")
    p.add_argument("--data-dir", default="peerd-data")

    p = sub.add_parser("owner-key", help="create a run owner key for admission mode 'invite'")
    p.add_argument("path", help="where to write the private key (mode 0600)")

    p = sub.add_parser("invite", help="sign an invitation that admits one peer key to an 'invite' run")
    p.add_argument("--owner-key", required=True, help="the run owner's private key file (peerd owner-key)")
    p.add_argument("--peer-key", required=True, help="the invited peer's public key, hex (peerd key)")
    p.add_argument("--expires", default="7d", help="how long it is valid: 7d, 12h, 30m, 90s (default 7d)")
    p.add_argument("--out", help="write it here (mode 0600) instead of printing it")

    p = sub.add_parser("demo", help="start a local swarm of peers as separate processes and train for a while")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--outer-steps", type=int, default=5)
    p.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per outer step")
    p.add_argument("--algorithm", default="diloco", choices=["diloco", "streaming", "noloco"])
    p.add_argument("--codec", default="fp32", help="fp32 | bf16 | int8 | fp8 | e3m0 | int4 | sparse (with its recipe)")
    p.add_argument("--preset", default="tiny", help="model preset")
    p.add_argument("--json", action="store_true", help="make the last line of output a JSON summary")
    p.add_argument("--workdir", help="keep peers' data here (default: a temporary directory, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory with the peers' data and logs")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--init-from", help="every peer starts from this checkpoint.pt or .safetensors file")
    p.add_argument("--procs-per-peer", type=int, default=1, help="run every peer as N local processes (ranks)")

    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    try:
        return _dispatch(args)
    except ConfigError as exc:
        report(ConfigError(f"config error: {exc}"), debug)
        return 2
    except UserError as exc:
        report(exc, debug)
        return exc.code
    except KeyboardInterrupt:
        print("peerd: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        unexpected(exc, debug)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    """Run one command; the errors it raises become one line in main()."""
    if args.command == "init":
        write_template(args.path)
        print(f"wrote {args.path}; start the first peer with: peerd start --config {args.path} --listen 0.0.0.0:7000")
        return 0
    if args.command == "start":
        return _start(args)
    if args.command == "ensemble-eval":
        from peerd.ensemble_eval import run as ensemble_eval

        return ensemble_eval(args)
    if args.command == "status":
        from peerd.status import print_status

        return print_status(
            args.address,
            as_json=args.json,
            timeout=args.timeout,
            insecure=True if args.insecure else None,
            data_dir=args.data_dir,
            join_secret_file=args.join_secret_file,
            invite_file=args.invite_file,
        )
    if args.command in ("key", "owner-key", "invite"):
        from peerd.admission import AdmissionError

        try:
            return _keys(args)
        except AdmissionError as exc:
            print(f"peerd: {exc}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from peerd.demo import run_demo

        try:
            return run_demo(args)
        except (RuntimeError, TimeoutError) as exc:  # a peer died before serving, or the demo ran out of time
            raise UserError(f"demo failed: {exc}", code=1) from exc
    return 1


def _keys(args: argparse.Namespace) -> int:
    """`peerd key`, `peerd owner-key` and `peerd invite`."""
    import time

    from peerd import admission

    if args.command == "key":
        from peerd.identity import Identity

        ident = Identity.load_or_create(args.data_dir)
        print(f"public key {ident.public_key.hex()}\npeer id    {ident.peer_id}")
        return 0
    if args.command == "owner-key":
        public = admission.create_owner_key(args.path)
        print(f"wrote {args.path}; put this in the run config:")
        print(f'[admission]\nmode = "invite"\nowner_key = "{public.hex()}"')
        return 0
    owner = admission.load_owner_key(args.owner_key)
    peer_key = admission.parse_hex_key(args.peer_key, "--peer-key")
    expires = int(time.time() + admission.parse_duration(args.expires))
    invite = admission.Invite.issue(owner, peer_key, expires)
    if args.out:
        admission.write_private_file(args.out, invite.to_text().encode())
        print(f"wrote {args.out}: admits {admission.describe(peer_key)} until {time.ctime(expires)}")
    else:
        print(invite.to_text(), end="")
    return 0


def _check_start_args(args: argparse.Namespace) -> None:
    """What can be checked before anything starts: address syntax and ranges, numbers."""
    from peerd import bootstrap

    bootstrap.parse_hostport(args.listen, "--listen", allow_port_zero=True)
    for spec in args.bootstrap:
        bootstrap.parse_bootstrap(spec)
    if args.announce:
        bootstrap.parse_hostport(args.announce, "--announce")
    if args.metrics:
        bootstrap.parse_hostport(args.metrics, "--metrics", allow_port_zero=True)
    if args.shard is not None and args.shard < 0:
        raise UserError(f"--shard {args.shard}: must be >= 0 (any number; it is taken modulo data.num_shards)")
    if args.join_timeout is not None and not args.join_timeout > 0:
        raise UserError(f"--join-timeout {args.join_timeout}: must be > 0 seconds")


def _check_checkpoint(path: Path) -> None:
    """Refuse a damaged checkpoint before joining anyone, and say what to do about it."""
    from trainer.checkpoint import CheckpointError, verify_checkpoint

    try:
        verify_checkpoint(path)
    except CheckpointError as exc:
        raise UserError(
            f"{exc}; move it away (mv {path} {path}.bad) to start from the swarm's state, or restore a good copy"
        ) from exc
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); fix its permissions or move it away") from exc


def _finished_in_checkpoint(path: Path, target: int) -> int | None:
    """The outer step our checkpoint holds when it already reached the run's last one (`target` > 0), else None."""
    from trainer.checkpoint import CheckpointError, load_checkpoint

    try:
        state = load_checkpoint(path)
    except (CheckpointError, OSError):
        return None
    step = int(state.get("outer_step", -1)) if state else -1
    return step if 0 < target <= step else None


def _init_digest(cfg: RunConfig, init_from: str | None) -> Path | None:
    """Check --init-from against the spec before joining: the file's sha256 becomes run.init_digest (part of the run
    id), or must equal it when the config names one; a config that names one needs the file."""
    if not init_from:
        if cfg.run.init_digest:
            raise UserError(
                f"run.init_digest is set ({cfg.run.init_digest[:12]}...): start with --init-from FILE, the weights "
                "file with that sha256 every peer of this run starts from"
            )
        return None
    from trainer.initfrom import InitError, check_init_file, file_digest

    try:
        check_init_file(init_from)
        digest = file_digest(init_from)
    except InitError as exc:
        raise UserError(str(exc)) from exc
    if cfg.run.init_digest and cfg.run.init_digest != digest:
        raise UserError(
            f"--init-from {init_from} has sha256 {digest[:12]}..., the config's run.init_digest is "
            f"{cfg.run.init_digest[:12]}...: use the file the run starts from"
        )
    cfg.run.init_digest = digest
    return Path(init_from)


def _start(args: argparse.Namespace) -> int:
    from peerd import launch

    rank, world = launch.env_rank()
    if rank > 0:  # torchrun, or our own rank 0, started us as one of this peer's other ranks
        return launch.run_follower(args)
    if args.procs_per_peer < 1 or args.procs_per_peer > 64:
        raise UserError(f"--procs-per-peer must be in [1, 64], got {args.procs_per_peer}")
    if args.procs_per_peer > 1 and world > 1:
        raise UserError("--procs-per-peer with torchrun: let torchrun start the ranks (--nproc-per-node), not both")
    followers = launch.spawn_followers(args, sys.argv[1:]) if args.procs_per_peer > 1 else []
    try:
        return _start_rank0(args, launch.join_ranks(args, 0) if followers or world > 1 else None)
    finally:
        launch.stop_followers(followers)


def _start_rank0(args: argparse.Namespace, ranks: object) -> int:
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # grpc's own debug lines ("Loaded running loop", one per call) buried peerd's under --debug
    logging.getLogger("grpc").setLevel(max(level, logging.INFO))
    log = logging.getLogger("peerd")
    _check_start_args(args)
    cfg = RunConfig.load(args.config)
    init_from = _init_digest(cfg, args.init_from)
    from peerd import bootstrap, datadir

    data_dir = Path(args.data_dir)
    lock = datadir.prepare(data_dir)  # writable, and no other daemon on it
    bootstrap.check_port_free(args.listen, "--listen")
    if args.metrics:
        bootstrap.check_port_free(args.metrics, "--metrics")
    from peerd.worker import CHECKPOINT

    _check_checkpoint(data_dir / CHECKPOINT)
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from peerd.admission import AdmissionError
    from peerd.daemon import Daemon
    from peerd.errors import Interrupted
    from peerd.gossip import JoinError
    from peerd.identity import Identity, IdentityError
    from peerd.shutdown import DRAIN_S, Shutdown, guard_exit
    from peerd.worker import Worker
    from trainer.checkpoint import CheckpointError

    try:
        identity = Identity.load_or_create(data_dir)
    except IdentityError as exc:
        raise UserError(str(exc)) from exc
    if args.insecure:
        log.warning("--insecure: gRPC traffic is NOT encrypted; use this for tests only")
    if args.join_secret_file:
        cfg.security.join_secret_file = args.join_secret_file
    if args.invite_file:
        cfg.security.invite_file = args.invite_file
    try:
        daemon = Daemon(
            cfg,
            identity,
            listen=args.listen,
            bootstrap=args.bootstrap,
            announce=args.announce,
            data_dir=data_dir,
            metrics_listen=args.metrics,
            insecure=args.insecure,
        )
    except AdmissionError as exc:
        raise UserError(str(exc)) from exc
    shutdown = Shutdown()
    shutdown.install()
    try:
        daemon.start(join_timeout=args.join_timeout or cfg.network.join_timeout)
    except Interrupted as exc:
        log.info("received %s while starting: stopped", exc)
        daemon.stop(leave=False, drain=0.5)
        return 0
    except JoinError as exc:
        done = _finished_in_checkpoint(data_dir / CHECKPOINT, cfg.run.outer_steps)
        if done is None:
            daemon.stop(leave=False, drain=0.5)
            raise UserError(str(exc), code=1) from exc
        # A peer restarted after the others finished and left: its own checkpoint is the end of the run.
        log.warning(
            "%s; our checkpoint already holds the run's last outer step (%d): reporting it, nothing to train", exc, done
        )
        daemon.go_on()
    except OSError as exc:
        daemon.stop(leave=False, drain=0.5)
        raise UserError(str(exc), code=1) from exc
    else:
        log.info("peer %s joined run %s (%s)", identity.peer_id[:8], daemon.run_id.hex()[:8], cfg.run.algorithm)
    live = _live_progress(daemon, cfg.run.outer_steps, shutdown.stop) if sys.stderr.isatty() else None
    worker = None
    try:
        together = args.wait_peers  # start together with this many peers (1: nobody to wait for at the barrier)
        if args.wait_peers > 1 and not daemon.wait_for_peers(args.wait_peers, shutdown.stop):
            together = 1
        try:
            worker = Worker(
                cfg,
                daemon,
                data_dir,
                device=args.device,
                shard=args.shard,
                on_outer_step=_log_outer_step,
                init_from=init_from,
                ranks=ranks,  # type: ignore[arg-type]
            )
        except ValueError as exc:  # bad model/data factory, data path, ...
            raise UserError(f"cannot start training: {exc}") from exc
        daemon.start_training(together)
        shutdown.training()
        try:
            worker.run(shutdown.stop)
        except CheckpointError as exc:
            path = data_dir / CHECKPOINT
            raise UserError(f"{exc}; move it away (mv {path} {path}.bad) to start from the swarm's state") from exc
        except ValueError as exc:  # e.g. a checkpoint of another run
            raise UserError(f"cannot train: {exc}") from exc
        finally:
            shutdown.stopping()
        worker.write_summary()
        if worker.stranded:
            raise UserError(
                f"the run finished at outer step {cfg.run.outer_steps} without this peer, and no live peer could "
                f"serve its final state: it stopped at outer step {worker.outer_step} rather than finish on a model "
                "of its own. Restart it with --bootstrap of a peer that still holds the run's end, or start a new run",
                code=1,
            )
    except Interrupted as exc:
        shutdown.stopping()
        kept = "no checkpoint was written yet"
        if worker is not None and worker.saved_step is not None:
            kept = f"the checkpoint of outer step {worker.saved_step} is kept"
        log.info("received %s: stopped without finishing the step in progress; %s", exc, kept)
        if worker is not None:
            worker.write_summary()
        return 0
    finally:
        shutdown.stopping()
        if live is not None:
            live.close()
        daemon.stop(leave=True, drain=shutdown.drain_s(DRAIN_S))
        lock.release()
    log.info("stopped cleanly at outer step %d", daemon.status.outer_step)
    guard_exit()
    return 0


def _live_progress(daemon: object, total: int, stop: threading.Event) -> object:
    """On a TTY: a live status line (step, loss, peers, bytes, ETA) redrawn from the daemon's status twice a second,
    under the log lines. Elsewhere the per-outer-step log lines are the progress."""
    from peerd.progress import Progress

    progress = Progress(stream=sys.stderr, total_steps=total or None)

    def loop() -> None:
        st = daemon.status  # type: ignore[attr-defined]
        while not stop.wait(0.5) and not st.finished:
            progress.update(
                step=st.outer_step,
                loss=st.loss,
                peers=len(daemon.membership.view.alive),  # type: ignore[attr-defined]
                sent=st.bytes_sent_wire,
                tokens_per_second=st.tokens_per_second,
            )

    class ToProgress(logging.Handler):
        """Log lines go above the live line instead of through it."""

        def emit(self, record: logging.LogRecord) -> None:
            progress.log(self.format(record))

    root = logging.getLogger()
    for h in list(root.handlers):
        handler = ToProgress()
        handler.setFormatter(h.formatter)
        root.removeHandler(h)
        root.addHandler(handler)
    threading.Thread(target=loop, name="peerd-progress", daemon=True).start()
    return progress


def _log_outer_step(worker: object) -> None:
    from peerd.worker import Worker

    assert isinstance(worker, Worker)
    st = worker.daemon.status
    rnd = st.last_round
    peers = f"{len(rnd.included)}/{len(rnd.expected)}" if rnd is not None else "-"
    secs = f"{rnd.seconds:.2f}s" if rnd is not None else "-"
    if rnd is not None and worker.daemon.cfg.run.algorithm == "diloco" and rnd.step + 1 < st.outer_step:
        # we reached this step by downloading the swarm's state (we were behind, or sat the round out): our last
        # round was an older step's, and showing its "peers 3/3" here claimed a round we were not in
        peers, secs = "- (state downloaded)", "-"
    sponsor = worker.daemon.me.sponsor
    if sponsor:  # our work goes through a sponsor's rounds: our own last round is old news, not this step's
        peers, secs = f"via sponsor {sponsor[:8]}", "-"
    logging.getLogger("peerd").info(
        "outer step %d | loss %.4f | eval %.4f | %.0f tok/s | peers %s | sent %.2f MB (wire %.2f MB) | round %s",
        st.outer_step,
        st.loss,
        st.eval_loss,
        st.tokens_per_second,
        peers,
        st.bytes_sent_raw / 1e6,
        st.bytes_sent_wire / 1e6,
        secs,
    )


def dump_json(obj: object) -> str:
    return json.dumps(obj, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
