#!/usr/bin/env bash
# What CI can prove of the image without a registry (the real base images cannot be
# pulled here): rebuild the Dockerfile's runtime stage FROM scratch with a locally built
# binary plus the shared libraries it links (what distroless/cc provides), with the
# runtime stage's own USER/ENV/EXPOSE/ENTRYPOINT/CMD lines copied verbatim; check the
# image config; unpack its root filesystem and run the binary inside it (chroot, as the
# image's user). `podman run` cannot work on this machine (rlimits), hence the chroot.
#
#   bash ci/chart/image-check.sh [path/to/outboxd]     exit 77 = skipped (no podman/buildah)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="$(realpath "${1:-target/debug/outboxd}")"
TAG="localhost/outboxd-ci-image-check:$$"

skip() { echo "SKIPPED: $*"; exit 77; }

if ! command -v podman >/dev/null && ! command -v buildah >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing podman (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman; } >/dev/null 2>&1 \
      || skip "podman could not be installed with apt-get"
  else
    skip "no podman or buildah, and cannot install them (not root or no apt-get)"
  fi
fi
if command -v podman >/dev/null; then TOOL=podman; else TOOL=buildah; fi
if [ "$(id -u)" != 0 ]; then skip "chroot into the unpacked image needs root"; fi

CTX="$(mktemp -d "${TMPDIR:-/tmp}/outboxd-image.XXXXXX")"
cleanup() {
  "$TOOL" rm -f outboxd-ci-image-check-$$ >/dev/null 2>&1 || true
  "$TOOL" rmi -f "$TAG" >/dev/null 2>&1 || true
  rm -rf "$CTX"
}
trap cleanup EXIT

# Root filesystem: the binary where the Dockerfile puts it, its libraries and loader, the
# nonroot user and a sticky /tmp like distroless.
ROOTFS="$CTX/rootfs"
install -D -m 0755 "$BIN" "$ROOTFS/usr/local/bin/outboxd"
for lib in $(ldd "$BIN" | grep -o '/[^ ]*' | sort -u); do
  install -D -m 0755 "$(realpath "$lib")" "$ROOTFS$lib"
done
mkdir -p "$ROOTFS/etc" "$ROOTFS/tmp" "$ROOTFS/home/nonroot"
chmod 1777 "$ROOTFS/tmp"
chown 65532:65532 "$ROOTFS/home/nonroot"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$ROOTFS/etc/group"

# The runtime stage's config lines, verbatim (so this image cannot drift from it).
STAGE="$(awk '/^FROM .* AS runtime/{on=1; next} on' Dockerfile)"
[ -n "$STAGE" ] || { echo "Dockerfile has no 'AS runtime' stage" >&2; exit 1; }
{
  echo "FROM scratch"
  echo "COPY rootfs/ /"
  echo "$STAGE" | grep -E '^(ENV|USER|EXPOSE|ENTRYPOINT|CMD|WORKDIR) '
} >"$CTX/Containerfile"
echo "--- Containerfile (runtime stage lines from Dockerfile)"
cat "$CTX/Containerfile"
if [ "$TOOL" = podman ]; then
  podman build --quiet --network=none -t "$TAG" -f "$CTX/Containerfile" "$CTX" >/dev/null
else
  buildah bud --quiet -t "$TAG" -f "$CTX/Containerfile" "$CTX" >/dev/null
fi

# Image config.
CONFIG="$("$TOOL" image inspect "$TAG" --format '{{json .Config}}' 2>/dev/null \
  || "$TOOL" inspect --type image --format '{{json .OCIv1.Config}}' "$TAG")"
echo "--- image config: $CONFIG"
python3 - "$CONFIG" <<'PY'
import json, sys
c = json.loads(sys.argv[1])
def need(ok, what):
    if not ok:
        sys.exit(f"image config: {what}: {c}")
need(c.get("Entrypoint") == ["/usr/local/bin/outboxd"], "entrypoint")
need(c.get("Cmd") == ["serve"], "cmd")
user = c.get("User", "")
need(user and user.split(":")[0] not in ("", "0", "root"), "user is not non-root")
need("50051/tcp" in (c.get("ExposedPorts") or {}), "port 50051 not exposed")
print(f"image config ok: user {user}, entrypoint {c['Entrypoint']}, cmd {c['Cmd']}")
PY

# Unpack the image's filesystem and run the binary inside it as the image's user.
UNPACKED="$CTX/unpacked"
mkdir -p "$UNPACKED"
if [ "$TOOL" = podman ]; then
  podman create --name outboxd-ci-image-check-$$ "$TAG" >/dev/null
  podman export outboxd-ci-image-check-$$ | tar -x -C "$UNPACKED"
else
  CTR="$(buildah from --name outboxd-ci-image-check-$$ "$TAG")"
  MNT="$(buildah mount "$CTR")"
  cp -a "$MNT/." "$UNPACKED/"
  buildah umount "$CTR" >/dev/null
fi
USER_SPEC="$("$TOOL" image inspect "$TAG" --format '{{.Config.User}}' 2>/dev/null || echo 65532:65532)"
if find "$UNPACKED" -perm /6000 -type f | grep -q .; then echo "setuid/setgid files in the image" >&2; exit 1; fi
echo "--- image files: $(cd "$UNPACKED" && find . -type f | sort | tr '\n' ' ')"
VERSION="$(chroot --userspec="$USER_SPEC" "$UNPACKED" /usr/local/bin/outboxd --version)"
EXPECTED="$("$BIN" --version)"
[ "$VERSION" = "$EXPECTED" ] || { echo "inside the image: '$VERSION', expected '$EXPECTED'" >&2; exit 1; }
echo "inside the image as $USER_SPEC: $VERSION"
# Serving without a database URL must fail fast and say why (no PostgreSQL in the image).
set +e
OUT="$(cd / && timeout 60 env -i PATH=/usr/local/bin:/usr/bin:/bin OUTBOX_LISTEN_ADDR=127.0.0.1:0 \
  "$(command -v chroot)" --userspec="$USER_SPEC" "$UNPACKED" /usr/local/bin/outboxd serve 2>&1)"
CODE=$?
set -e
if [ "$CODE" = 0 ] || [ "$CODE" = 124 ]; then echo "serve without a database exited $CODE: $OUT" >&2; exit 1; fi
echo "serve without OUTBOX_DATABASE__URL exits $CODE: $(echo "$OUT" | grep -m1 -i error || echo "$OUT" | tail -n1)"

# The builder stage's context, filtered by the repository's .dockerignore as the real build
# would be: it must hold what `cargo build --locked` reads and none of the local state.
if [ "$TOOL" = podman ]; then
  printf 'FROM scratch\nCOPY . /ctx/\n' >"$CTX/Containerfile.context"
  podman build --quiet --network=none -t "$TAG-context" -f "$CTX/Containerfile.context" . >/dev/null
  podman create --name outboxd-ci-image-context-$$ "$TAG-context" /ctx >/dev/null
  mkdir -p "$CTX/context"
  podman export outboxd-ci-image-context-$$ | tar -x -C "$CTX/context"
  podman rm -f outboxd-ci-image-context-$$ >/dev/null
  podman rmi -f "$TAG-context" >/dev/null
  for need in Cargo.toml Cargo.lock build.rs src/main.rs proto migrations; do
    [ -e "$CTX/context/ctx/$need" ] || { echo "build context lacks $need (.dockerignore)" >&2; exit 1; }
  done
  for never in target .git .outboxd; do
    [ ! -e "$CTX/context/ctx/$never" ] || { echo "build context includes $never (.dockerignore)" >&2; exit 1; }
  done
  if find "$CTX/context/ctx" -name node_modules -o -name __pycache__ | grep -q .; then
    echo "build context includes node_modules or __pycache__" >&2; exit 1
  fi
  echo "build context ($(du -sh "$CTX/context/ctx" | cut -f1)): has Cargo.toml Cargo.lock build.rs src proto migrations; no target .git .outboxd"
fi
echo "image check: ok ($TOOL $("$TOOL" --version | awk '{print $NF}'))"
