#!/usr/bin/env bash
# Make real WebGPU (Dawn -> Vulkan) work on a machine without a GPU, for ONNX Runtime's WebGPU plugin EP.
#
# What it does (Debian 12 "bookworm"; needs apt, root or passwordless sudo for the apt install step):
#   1. apt-installs the Vulkan loader `libvulkan1` if missing (apt-get update only when needed).
#   2. Fetches Mesa's lavapipe (software Vulkan) from <codename>-backports (Mesa >= 25; Debian 12's own
#      Mesa 22.3 is refused by Dawn) with `apt-get download` using a *private* apt configuration, and unpacks
#      it with `dpkg-deb -x` into a private cache folder. Nothing from Mesa is installed system-wide.
#      Shared libraries the driver needs (libLLVM-15, libxcb-*, ...) are apt-installed from the machine's own
#      repositories when missing.
#   3. Writes an ICD manifest pointing at the unpacked libvulkan_lvp.so and an env file with
#      VK_ICD_FILENAMES and ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1.
# It does not touch Python packages and does not need a GPU. Re-running is a quick no-op.
#
# Usage:   tools/setup_webgpu.sh [--force]
#          env_file="$(tools/setup_webgpu.sh)" && source "$env_file"
# stdout:  only the path of the env file (last line). Progress goes to stderr.
# Env:     ORTCAPTURE_CACHE      cache root (default: $HOME/.cache/ortcapture)
#          ORTCAPTURE_DEBIAN_MIRROR  Debian mirror URI (default: taken from the machine's apt sources)
#          ORTCAPTURE_MESA_MIN   minimum Mesa version accepted (default: 25)
# Exit:    0 ok, 1 failure, 2 bad usage, 3 not a Debian/apt machine.
set -euo pipefail

log() { printf 'setup_webgpu: %s\n' "$*" >&2; }
warn() { printf 'setup_webgpu: WARNING: %s\n' "$*" >&2; }
die() { printf 'setup_webgpu: ERROR: %s\n' "$1" >&2; exit "${2:-1}"; }

FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 0 ;;
        *) die "unknown argument: $arg (usage: $0 [--force])" 2 ;;
    esac
done

# ---------------------------------------------------------------- platform checks
for tool in apt-get apt-cache dpkg-query dpkg-deb dpkg; do
    command -v "$tool" >/dev/null 2>&1 \
        || die "'$tool' not found: this script needs a Debian-based system with apt/dpkg (made for Debian 12 bookworm)." 3
done
[ "$(uname -s)" = Linux ] || die "not Linux" 3

CODENAME=""
if [ -r /etc/os-release ]; then
    CODENAME="$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")"
    OS_ID="$(. /etc/os-release && printf '%s' "${ID:-}")"
    [ "$OS_ID" = debian ] || warn "made for Debian, this is '${OS_ID}'; trying anyway"
fi
[ -n "$CODENAME" ] || die "cannot tell the Debian codename from /etc/os-release" 3
MESA_MIN="${ORTCAPTURE_MESA_MIN:-25}"

CACHE="${ORTCAPTURE_CACHE:-${HOME:?HOME is not set}/.cache/ortcapture}"
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd -P)"   # absolute, so the ICD/env paths are absolute
LVP_DIR="$CACHE/lavapipe"          # unpacked driver + ICD manifest
LIB="$LVP_DIR/libvulkan_lvp.so"
ICD="$LVP_DIR/lvp_icd.json"
STAMP="$LVP_DIR/.complete"         # holds the Mesa version; written last
ENV_FILE="$CACHE/webgpu.env"

# One run at a time per cache (parallel CI jobs / test workers).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/.setup_webgpu.lock"
    flock 9
fi

if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo -n); fi
export DEBIAN_FRONTEND=noninteractive

pkg_installed() {
    local st
    st="$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" || return 1
    [[ "$st" == *" installed" ]]
}

APT_UPDATED=0
apt_install() {  # apt_install PKG...  (only the missing ones are passed in)
    [ "$#" -gt 0 ] || return 0
    if [ "${#SUDO[@]}" -gt 0 ] && ! command -v sudo >/dev/null 2>&1; then
        die "need to apt-get install $*; run as root (or with passwordless sudo), or install them first"
    fi
    local need_update=0 p
    for p in "$@"; do   # (no `| grep -q` here: with pipefail, SIGPIPE would fail the pipeline)
        [[ "$(apt-cache policy "$p" 2>/dev/null)" == *"Candidate: "[!\(]* ]] || need_update=1
    done
    if [ "$need_update" -eq 1 ] && [ "$APT_UPDATED" -eq 0 ]; then
        log "apt-get update (package lists lack: $*)"
        "${SUDO[@]}" apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install $*"
    if ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "$@" >&2; then
        [ "$APT_UPDATED" -eq 0 ] || die "apt-get install $* failed"
        log "install failed; apt-get update and retry"
        "${SUDO[@]}" apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
        "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "$@" >&2 || die "apt-get install $* failed"
    fi
}

# ldd_check LIB -> 0 clean (warns on undefined symbols), 1 if shared libraries are missing
ldd_check() {
    local out missing undef
    out="$(LC_ALL=C ldd -r "$1" 2>&1)" || true
    missing="$(printf '%s\n' "$out" | grep 'not found' || true)"
    undef="$(printf '%s\n' "$out" | grep -E 'undefined symbol' || true)"
    if [ -n "$undef" ]; then
        warn "ldd -r $1 reports undefined symbols (the driver may still work):"
        printf '%s\n' "$undef" | head -n 20 | sed 's/^/    /' >&2
    fi
    if [ -n "$missing" ]; then
        warn "ldd -r $1: missing shared libraries:"
        printf '%s\n' "$missing" | sed 's/^/    /' >&2
        return 1
    fi
    return 0
}

write_env() {
    local tmp="$ENV_FILE.tmp.$$"
    {
        echo "# written by tools/setup_webgpu.sh: software WebGPU via Mesa lavapipe $(cat "$STAMP")"
        printf 'export VK_ICD_FILENAMES=%q\n' "$ICD"
        echo 'export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1'
        # lavapipe compiles the reference model's shaders in ~35 s; Mesa's disk cache makes later runs ~4 s
        printf 'export MESA_SHADER_CACHE_DIR=%q\n' "$CACHE/mesa_shader_cache"
    } >"$tmp"
    mv -f "$tmp" "$ENV_FILE"
}

# ---------------------------------------------------------------- fast path
if [ "$FORCE" -eq 0 ] && pkg_installed libvulkan1 && [ -s "$STAMP" ] && [ -f "$LIB" ] && [ -f "$ICD" ] \
        && grep -qF "\"$LIB\"" "$ICD" && [ -f "$ENV_FILE" ] && grep -qF "$ICD" "$ENV_FILE" && grep -qF MESA_SHADER_CACHE_DIR "$ENV_FILE" \
        && ldd_check "$LIB" 2>/dev/null; then
    log "already set up (lavapipe $(cat "$STAMP") in $LVP_DIR)"
    echo "$ENV_FILE"
    exit 0
fi

# ---------------------------------------------------------------- 1. Vulkan loader
if pkg_installed libvulkan1; then
    log "libvulkan1 already installed"
else
    apt_install libvulkan1
fi

# ---------------------------------------------------------------- 2. lavapipe from backports
if [ "$FORCE" -eq 1 ] || [ ! -s "$STAMP" ] || [ ! -f "$LIB" ]; then
    # Mirror: ORTCAPTURE_DEBIAN_MIRROR, else the URI the machine uses for its main suite, else deb.debian.org.
    MIRROR="${ORTCAPTURE_DEBIAN_MIRROR:-}"
    KEYRING=""
    if [ -z "$MIRROR" ]; then
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -r "$f" ] || continue
            # deb822 stanzas: first stanza with Types: deb whose Suites contain exactly $CODENAME
            line="$(awk -v cn="$CODENAME" 'BEGIN{RS=""; FS="\n"}
                {
                    uris=""; suites=""; types=""; key=""
                    for (i = 1; i <= NF; i++) {
                        if ($i ~ /^[ \t]*#/) continue
                        if ($i ~ /^URIs:/)      { uris=$i;   sub(/^URIs:[ \t]*/, "", uris) }
                        if ($i ~ /^Suites:/)    { suites=$i; sub(/^Suites:[ \t]*/, "", suites) }
                        if ($i ~ /^Types:/)     { types=$i;  sub(/^Types:[ \t]*/, "", types) }
                        if ($i ~ /^Signed-By:/) { key=$i;    sub(/^Signed-By:[ \t]*/, "", key) }
                    }
                    if ($0 ~ /(^|\n)Enabled:[ \t]*no/) next
                    n = split(suites, s, /[ \t]+/)
                    if (types ~ /(^|[ \t])deb([ \t]|$)/) for (j = 1; j <= n; j++) if (s[j] == cn) {
                        split(uris, u, /[ \t]+/); print u[1] "\t" key; exit
                    }
                }' "$f")"
            if [ -n "$line" ]; then
                MIRROR="${line%%$'\t'*}"; KEYRING="${line#*$'\t'}"; break
            fi
        done
    fi
    if [ -z "$MIRROR" ]; then
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [ -r "$f" ] || continue
            MIRROR="$(awk -v cn="$CODENAME" '$1 == "deb" {
                    i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ($(i + 1) == cn) { print $i; exit } }' "$f")"
            [ -n "$MIRROR" ] && break
        done
    fi
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
    MIRROR="${MIRROR%/}"
    case "$KEYRING" in /*) [ -f "$KEYRING" ] || KEYRING="" ;; *) KEYRING="" ;; esac
    if [ -z "$KEYRING" ] && [ -f /usr/share/keyrings/debian-archive-keyring.gpg ]; then
        KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
    fi
    SUITE="$CODENAME-backports"
    log "fetching mesa-vulkan-drivers from $MIRROR $SUITE"

    WORK="$CACHE/.lavapipe.work.$$"
    rm -rf "$WORK"
    trap 'rm -rf "$WORK"' EXIT
    APTD="$WORK/apt"
    mkdir -p "$APTD/lists/partial" "$APTD/cache/archives/partial" "$WORK/deb" "$WORK/x"
    opts=""; [ -n "$KEYRING" ] && opts="[signed-by=$KEYRING] "
    printf 'deb %s%s %s main\n' "$opts" "$MIRROR" "$SUITE" >"$APTD/sources.list"
    APT_OPTS=(-o "Dir::Etc::sourcelist=$APTD/sources.list" -o "Dir::Etc::sourceparts=-"
              -o "Dir::State::Lists=$APTD/lists" -o "Dir::Cache=$APTD/cache"
              -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "Debug::NoLocking=1")
    [ "$(id -u)" -eq 0 ] && APT_OPTS+=(-o "APT::Sandbox::User=root")   # private dirs are not _apt-readable
    apt-get "${APT_OPTS[@]}" update -qq >&2 || die "apt-get update of $MIRROR $SUITE failed"
    VER="$(apt-cache "${APT_OPTS[@]}" policy mesa-vulkan-drivers | awk '/Candidate:/ {print $2}')"
    case "$VER" in ''|'(none)') die "mesa-vulkan-drivers not found in $MIRROR $SUITE" ;; esac
    dpkg --compare-versions "$VER" ge "$MESA_MIN" \
        || die "mesa-vulkan-drivers in $SUITE is $VER, need >= $MESA_MIN (Dawn refuses older lavapipe)"
    (cd "$WORK/deb" && apt-get "${APT_OPTS[@]}" download -qq "mesa-vulkan-drivers=$VER" >&2) \
        || die "apt-get download mesa-vulkan-drivers=$VER failed"
    DEB="$(ls "$WORK"/deb/mesa-vulkan-drivers_*.deb)"
    dpkg-deb -x "$DEB" "$WORK/x"
    SO="$(find "$WORK/x" -name libvulkan_lvp.so -type f | head -n1)"
    [ -n "$SO" ] || die "libvulkan_lvp.so not in $DEB"
    API="$(grep -o '"api_version"[^,}]*' "$WORK"/x/usr/share/vulkan/icd.d/lvp_icd*.json 2>/dev/null \
           | head -n1 | sed 's/.*: *"\([^"]*\)".*/\1/')"
    DEPS="$(dpkg-deb -f "$DEB" Depends)"

    # Keep only what is needed; swap in atomically.
    NEW="$WORK/lavapipe"
    mkdir -p "$NEW"
    cp "$SO" "$NEW/libvulkan_lvp.so"
    cp "$WORK"/x/usr/share/doc/mesa-vulkan-drivers/copyright "$NEW/copyright" 2>/dev/null || true
    printf '%s\n' "${API:-1.4.305}" >"$NEW/api_version"
    printf '%s\n' "$DEPS" >"$NEW/depends"
    printf '%s\n' "$VER" >"$NEW/.complete"
    rm -rf "$LVP_DIR.old"
    [ -e "$LVP_DIR" ] && mv "$LVP_DIR" "$LVP_DIR.old"
    mv "$NEW" "$LVP_DIR"
    rm -rf "$LVP_DIR.old" "$WORK"
    trap - EXIT
    log "unpacked lavapipe $VER into $LVP_DIR"
else
    log "lavapipe $(cat "$STAMP") already in $LVP_DIR"
fi

# ---------------------------------------------------------------- runtime libraries of the driver
# The package's Depends name the libraries (libLLVM-15, libxcb-*, libwayland-client...). Bookworm's
# versions are older than backports asks for, but they work (ldd -r clean); install only missing names.
if ! ldd_check "$LIB" 2>/dev/null; then
    missing=()
    if [ -f "$LVP_DIR/depends" ]; then
        while IFS= read -r dep; do
            dep="${dep%%|*}"; dep="${dep%%(*}"; dep="${dep%%:*}"; dep="$(echo "$dep" | tr -d '[:space:]')"
            [ -n "$dep" ] && ! pkg_installed "$dep" && missing+=("$dep")
        done < <(tr ',' '\n' <"$LVP_DIR/depends")
    fi
    [ "${#missing[@]}" -gt 0 ] && apt_install "${missing[@]}"
fi
ldd_check "$LIB" || die "libvulkan_lvp.so cannot load: missing shared libraries (see above)"

# ---------------------------------------------------------------- 3. ICD manifest + env file
API="$(cat "$LVP_DIR/api_version" 2>/dev/null || echo 1.4.305)"
LIB_JSON="$(printf '%s' "$LIB" | sed 's/\\/\\\\/g; s/"/\\"/g')"
printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "%s"}}\n' \
    "$LIB_JSON" "$API" >"$ICD.tmp.$$"
mv -f "$ICD.tmp.$$" "$ICD"
write_env
log "ready: source $ENV_FILE"
echo "$ENV_FILE"
