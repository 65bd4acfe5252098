#!/usr/bin/env bash
# Set up rootless Podman for reinforge's sandboxes. Idempotent: a second run takes seconds.
#
# As root (CI, fresh Debian 12): installs podman + runc + uidmap + slirp4netns + fuse-overlayfs
# (+ debootstrap for the offline image), creates the unprivileged user that runs Podman
# ($REINFORGE_SANDBOX_USER, default "reinforge-sandbox"), configures its runtime (runc only where
# crun refuses, i.e. hybrid/v1 cgroups) and storage (overlay), starts `podman system service`
# as that user in the background, and builds (or reuses) the default sandbox image.
# As an ordinary user: installs nothing; checks, configures that user's own Podman, starts the
# service and builds the image, and says what is missing.
#
# Socket convention (read by reinforge.envs.sandbox.box.default_podman_url):
#   /run/user/<uid of the podman user>/podman/podman.sock  (REINFORGE_PODMAN_URL overrides)
set -euo pipefail

SANDBOX_USER="${REINFORGE_SANDBOX_USER:-reinforge-sandbox}"
IMAGE="${REINFORGE_SANDBOX_IMAGE:-localhost/reinforge-sandbox-python:bookworm}"
PULL_IMAGE="${REINFORGE_PULL_IMAGE:-docker.io/library/python:3.11-slim}"
CACHE_DIR="${REINFORGE_IMAGE_CACHE:-/var/cache/reinforge}"
log() { printf 'setup_podman: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [ "$(id -u)" -eq 0 ]; then
    AS_ROOT=1
else
    AS_ROOT=0
    SANDBOX_USER="$(id -un)"
    CACHE_DIR="${REINFORGE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/reinforge}"
fi

# --- 1. packages ---------------------------------------------------------------------------
need_pkgs=()
for pair in podman:podman runc:runc newuidmap:uidmap slirp4netns:slirp4netns \
            fuse-overlayfs:fuse-overlayfs catatonit:catatonit debootstrap:debootstrap; do
    cmd="${pair%%:*}"; pkg="${pair##*:}"
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || [ -x "/usr/libexec/podman/$cmd" ] || need_pkgs+=("$pkg")
done
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    if [ "$AS_ROOT" -eq 1 ]; then
        log "installing ${need_pkgs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
    else
        for p in "${need_pkgs[@]}"; do
            [ "$p" = debootstrap ] && continue  # only needed to build the image offline
            die "missing package $p: ask an administrator to run 'apt-get install ${need_pkgs[*]}'"
        done
    fi
fi

# --- 2. the user that runs Podman ------------------------------------------------------------
if [ "$AS_ROOT" -eq 1 ]; then
    if ! id "$SANDBOX_USER" >/dev/null 2>&1; then
        log "creating user $SANDBOX_USER"
        useradd -m -s /bin/bash "$SANDBOX_USER"
    fi
    for f in /etc/subuid /etc/subgid; do
        grep -q "^$SANDBOX_USER:" "$f" 2>/dev/null || {
            # useradd normally adds these; pick a free 65536 range past the highest one
            last=$(awk -F: '{e=$2+$3} e>m{m=e} END{print m+0}' "$f" 2>/dev/null || echo 0)
            start=$(( last > 100000 ? last : 100000 ))
            echo "$SANDBOX_USER:$start:65536" >>"$f"
        }
    done
fi
SB_UID="$(id -u "$SANDBOX_USER")"
SB_HOME="$(getent passwd "$SANDBOX_USER" | cut -d: -f6)"
RUNDIR="/run/user/$SB_UID"
if [ "$AS_ROOT" -eq 1 ]; then
    install -d -m 0700 -o "$SANDBOX_USER" -g "$(id -gn "$SANDBOX_USER")" "$RUNDIR"
else
    RUNDIR="${XDG_RUNTIME_DIR:-$RUNDIR}"
    [ -d "$RUNDIR" ] && [ -w "$RUNDIR" ] || die "XDG_RUNTIME_DIR $RUNDIR is missing or not writable (log in through systemd-logind, or export XDG_RUNTIME_DIR to a private 0700 dir)"
fi
grep -q "^$SANDBOX_USER:" /etc/subuid 2>/dev/null \
    || die "no /etc/subuid entry for $SANDBOX_USER: ask an administrator to run 'usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $SANDBOX_USER'"

# run a command as the podman user, with its runtime dir
as_user() {
    if [ "$AS_ROOT" -eq 1 ]; then
        runuser -u "$SANDBOX_USER" -- env -i HOME="$SB_HOME" USER="$SANDBOX_USER" \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            XDG_RUNTIME_DIR="$RUNDIR" "$@"
    else
        env XDG_RUNTIME_DIR="$RUNDIR" "$@"
    fi
}

# --- 3. runtime and storage config -------------------------------------------------------------
CONF_DIR="$SB_HOME/.config/containers"
CONF="$CONF_DIR/containers.conf"
as_user mkdir -p "$CONF_DIR"
# engine_set KEY VALUE [keep]: `KEY = VALUE` in the [engine] table of the podman user's
# containers.conf, other settings untouched; with "keep", a KEY already there is left alone.
engine_set() {
    local key="$1" value="$2" keep="${3:-}" cur new
    cur="$(as_user cat "$CONF" 2>/dev/null || true)"
    new="$({ [ -z "$cur" ] || printf '%s\n' "$cur"; } | awk -v k="$key" -v v="$value" -v keep="$keep" '
        function header(line) { gsub(/^[ \t]*\[+|\]+[ \t]*(#.*)?$/, "", line); return line }
        /^[ \t]*\[/ { if (sec == "engine" && !done) { print k " = " v; done = 1 }
                      sec = header($0); print; next }
        sec == "engine" && $0 ~ ("^[ \t]*" k "[ \t]*=") {
            if (keep == "keep") print; else print k " = " v; done = 1; next }
        { print }
        END { if (!done) { if (sec != "engine") print "[engine]"; print k " = " v } }')"
    if [ "$new" != "$cur" ]; then
        log "setting $key = $value in $CONF"
        printf '%s\n' "$new" | as_user sh -c "cat > '$CONF'"
    fi
}
if [ "$(stat -fc %T /sys/fs/cgroup)" != "cgroup2fs" ]; then
    # hybrid or v1 cgroups: crun refuses ("cgroups in hybrid mode not supported"); runc works
    engine_set runtime '"runc"'
fi
# Every exec through the API keeps two conmon processes (and its session) alive for
# exit_command_delay after it ended: Podman's default 300 s ("mimics Docker") means thousands
# of processes at a few execs a second. The sandbox reads an exec's status right after it ends.
EXIT_DELAY_S="${REINFORGE_EXEC_CLEANUP_DELAY_S:-10}"
if [ "$AS_ROOT" -eq 1 ]; then
    engine_set exit_command_delay "$EXIT_DELAY_S"
else
    engine_set exit_command_delay "$EXIT_DELAY_S" keep  # the user's own Podman: theirs if set
fi
if ! grep -qs 'driver *= *"overlay"' "$CONF_DIR/storage.conf"; then
    log "setting the overlay storage driver for $SANDBOX_USER"
    as_user sh -c "printf '[storage]\ndriver = \"overlay\"\n' > '$CONF_DIR/storage.conf'"
    if as_user podman info --format '{{.Store.GraphDriverName}}' 2>/dev/null | grep -q vfs; then
        as_user podman system reset -f >/dev/null 2>&1 || true
    fi
fi

# --- 4. the API service -------------------------------------------------------------------------
SOCK="$RUNDIR/podman/podman.sock"
service_up() {
    [ -S "$SOCK" ] && curl -fsS --max-time 3 --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1
}
if ! command -v curl >/dev/null 2>&1; then
    service_up() { [ -S "$SOCK" ] && as_user podman --url "unix://$SOCK" version >/dev/null 2>&1; }
fi
# the service reads containers.conf when it starts: restart one older than the file
# (containers keep running: rootless Podman has no daemon; in-flight API calls fail)
service_pid() {
    local pid
    pid="$(cat "$RUNDIR/podman/service.pid" 2>/dev/null || true)"
    if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "system service .*unix://$SOCK"; then
        echo "$pid"; return
    fi
    pgrep -u "$SB_UID" -f "podman system service .*unix://$SOCK\$" | head -n 1 || true
}
# ... and one whose working directory was deleted (it was started from a checkout since
# removed): conmon then fails every container with "Failed to get working directory"
if service_up; then
    pid="$(service_pid)"
    if [ -n "$pid" ]; then
        started_s=$(( $(date +%s) - $(ps -o etimes= -p "$pid" | tr -d ' ') ))
        why=""
        if [ -f "$CONF" ] && [ "$(stat -c %Y "$CONF")" -gt "$started_s" ]; then
            why="to read the new $CONF"
        elif [ "$(stat -L -c %h "/proc/$pid/cwd" 2>/dev/null)" = 0 ]; then  # no links left
            why="whose working directory was deleted"
        fi
        if [ -n "$why" ]; then
            log "restarting podman system service (pid $pid) $why"
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
            rm -f "$SOCK"
        fi
    fi
fi
if ! service_up; then
    # A machine restored without its processes (while /run survived) leaves Podman's runtime
    # state saying containers run, with their conmons and the pause process (the user
    # namespace) gone: every podman command then fails with "invalid internal status".
    # `podman system migrate` marks those containers stopped and starts a fresh namespace.
    info_err="$(as_user podman info 2>&1 >/dev/null || true)"
    if [[ "$info_err" == *"invalid internal status"* ]]; then
        log "Podman's processes are gone but $RUNDIR says they run: podman system migrate"
        as_user podman system migrate >/dev/null 2>&1 || die "podman system migrate failed"
    fi
    log "starting podman system service at $SOCK"
    as_user mkdir -p "$RUNDIR/podman"
    rm -f "$SOCK"
    # from /, never the caller's folder: a service outlives the checkout that started it
    as_user sh -c 'cd / && echo $$ > "$1/podman/service.pid" && exec setsid nohup podman system service --time=0 "unix://$2"' \
        sh "$RUNDIR" "$SOCK" >"$RUNDIR/podman/service.log" 2>&1 </dev/null &
    for _ in $(seq 1 100); do service_up && break; sleep 0.1; done
    service_up || die "podman system service did not come up; see $RUNDIR/podman/service.log"
fi
# root reaches the socket through its parent dirs (0700, owned by the podman user): root bypasses
# file modes, so nothing to open up here.

# --- 5. the default image -----------------------------------------------------------------------
# The image carries /usr/local/bin/reinforge-sh: a copy of dash, root-owned, mode 0711. A process
# that execs a binary it can't read is non-dumpable, so the task wrapper that runs as the
# candidate's uid can't be ptraced, have its memory written or its environment read by the
# candidate's (or a previous task's) processes. IMAGE_VERSION marks images that have it.
IMAGE_VERSION=2
image_version() {
    as_user podman image inspect --format '{{index .Labels "reinforge.sandbox.version"}}' "$IMAGE" 2>/dev/null || true
}
CHANGES=(--change 'CMD ["/bin/sh"]' --change "LABEL reinforge.sandbox.version=$IMAGE_VERSION")
if [ "$(image_version)" = "$IMAGE_VERSION" ]; then
    log "image $IMAGE already present"
else
    built=0
    if [ "${REINFORGE_OFFLINE:-0}" != 1 ] && as_user timeout 60 podman pull -q "$PULL_IMAGE" >/dev/null 2>&1; then
        CTX="$(as_user mktemp -d)"
        as_user sh -c "printf '%s\n' 'FROM $PULL_IMAGE' \
            'RUN cp \"\$(readlink -f /bin/sh)\" /usr/local/bin/reinforge-sh && chmod 0711 /usr/local/bin/reinforge-sh' \
            'LABEL reinforge.sandbox.version=$IMAGE_VERSION' > '$CTX/Containerfile'"
        if as_user podman build -q --network=none -t "$IMAGE" "$CTX" >/dev/null; then
            built=1 && log "pulled $PULL_IMAGE and built $IMAGE from it"
        fi
        as_user rm -rf "$CTX"
    fi
    if [ "$built" -eq 0 ]; then
        TARBALL="$CACHE_DIR/rootfs-bookworm-python3.tar"
        mkdir -p "$CACHE_DIR"
        if [ ! -s "$TARBALL" ]; then
            command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] \
                || die "no registry reachable and no debootstrap to build $IMAGE offline: install debootstrap (as root) or set REINFORGE_PULL_IMAGE to a reachable image"
            [ "$AS_ROOT" -eq 1 ] || die "building $IMAGE offline needs root (debootstrap); run this script once as root, or import a rootfs tarball at $TARBALL"
            ROOTFS="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
            log "building $IMAGE offline with debootstrap (about 40 s)"
            PATH="$PATH:/usr/sbin:/sbin" debootstrap --variant=minbase --include=python3 \
                bookworm "$ROOTFS" "${REINFORGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
            rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
            tar -C "$ROOTFS" -cf "$TARBALL.tmp" .
            mv "$TARBALL.tmp" "$TARBALL"
            rm -rf "$ROOTFS"
        fi
        if ! tar -tf "$TARBALL" ./usr/local/bin/reinforge-sh >/dev/null 2>&1; then
            EXTRA="$(mktemp -d)"
            mkdir -p "$EXTRA/usr/local/bin"
            tar -C "$EXTRA" -xf "$TARBALL" ./usr/bin/dash
            install -m 0711 "$EXTRA/usr/bin/dash" "$EXTRA/usr/local/bin/reinforge-sh"
            tar -C "$EXTRA" --owner=0 --group=0 -rf "$TARBALL" ./usr/local/bin/reinforge-sh
            rm -rf "$EXTRA"
        fi
        log "importing $TARBALL as $IMAGE"
        # the podman user can't read root's cache dir: stream the tarball through stdin
        as_user podman import -q "${CHANGES[@]}" - "$IMAGE" <"$TARBALL" >/dev/null
    fi
fi
[ "$(image_version)" = "$IMAGE_VERSION" ] || die "image $IMAGE missing or without the reinforge-sh wrapper after the build"
log "ready: user=$SANDBOX_USER url=unix://$SOCK image=$IMAGE"
echo "unix://$SOCK"
