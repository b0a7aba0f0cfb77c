#!/usr/bin/env bash
# Builds the pvisor guest kernel: Debian's linux-source-6.12 with this directory's patch
# series (00NN-*.patch, in order) and its config fragment (config, on top of tinyconfig).
# See README.md beside this script.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
package=linux-source-6.12

usage() {
    cat <<EOF
Usage: guest-patches/build.sh [options]

Fetches Debian's $package source package (unless it is cached), unpacks it into a
fresh tree, applies the series in guest-patches/, configures the kernel with
guest-patches/config on top of tinyconfig, compiles bzImage, and checks that every
C file the series changes was compiled.

Options:
  --cache DIR     where the package, the tree and the build go
                  (default: \$PVISOR_GUEST_KERNEL_CACHE, else $repo/target/guest-kernel)
  --version VER   the $package version to use, e.g. 6.12.117-1 (default: the newest
                  one cached, else the newest the suite has)
  --suite SUITE   the Debian suite to fetch it from (default: trixie)
  --apply-only    unpack and apply the series, then stop (no configure, no compile)
  --jobs N        parallel make jobs (default: $(nproc))
  -h, --help      this text

The package comes from the Debian mirror this machine's apt is already configured with,
through a private apt configuration in a temporary directory; the machine's own apt
sources are not changed. Missing build dependencies are installed with apt-get.
EOF
}

cache=${PVISOR_GUEST_KERNEL_CACHE:-$repo/target/guest-kernel}
version=
suite=trixie
apply_only=0
jobs=$(nproc)

while [ $# -gt 0 ]; do
    case "$1" in
        --cache) cache=${2:?--cache needs a directory}; shift 2 ;;
        --version) version=${2:?--version needs a version}; shift 2 ;;
        --suite) suite=${2:?--suite needs a suite}; shift 2 ;;
        --apply-only) apply_only=1; shift ;;
        --jobs) jobs=${2:?--jobs needs a number}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

started=$SECONDS
step() { printf '[%4ds] %s\n' $((SECONDS - started)) "$*"; }
die() { echo "build.sh: error: $*" >&2; exit 1; }

mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
tree_root=$cache/src
build=$cache/build
log=$cache/build.log

# --- dependencies -------------------------------------------------------------------------

need=(dpkg xz-utils tar patch)
if [ "$apply_only" = 0 ]; then
    need+=(make gcc bc flex bison libelf-dev libssl-dev perl)
fi
missing=()
for p in "${need[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing packages, install them first: ${missing[*]}"
    step "installing ${missing[*]}"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi

# --- the source package ---------------------------------------------------------------------

# The newest cached .deb (of $version if given), or nothing.
cached_deb() {
    local best= v f
    for f in "$cache/${package}_"*_all.deb; do
        [ -e "$f" ] || continue
        v=${f##*/${package}_}; v=${v%_all.deb}
        [ -z "$version" ] || [ "$v" = "$version" ] || continue
        if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v; fi
    done
    [ -z "$best" ] || echo "$cache/${package}_${best}_all.deb"
}

# The Debian archive this machine's apt uses, as "URI KEYRING": from the first deb822 stanza
# (or one-line entry) of the main archive, not of a security or updates suite.
debian_archive() {
    {
        local f
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -e "$f" ] || continue
            awk '
                function flush() {
                    if (uri != "" && suites ~ /(^| )[a-z]+( |$)/ && comps ~ /(^| )main( |$)/)
                        print uri, (key ~ /^\// ? key : "-")
                    uri = suites = comps = key = ""
                }
                /^[ \t]*$/ { flush(); next }
                /^URIs:/ { uri = $2 }
                /^Suites:/ { $1 = ""; suites = $0 }
                /^Components:/ { $1 = ""; comps = $0 }
                /^Signed-By:/ { key = $2 }
                END { flush() }
            ' "$f"
        done
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [ -e "$f" ] || continue
            awk '$1 == "deb" && / main( |$)/ {
                     for (i = 2; i <= NF; i++)
                         if ($i ~ /^[a-z+]+:\/\//) { print $i, "-"; break }
                 }' "$f"
        done
    } | head -n1
}

apt_tmp=
trap '[ -z "$apt_tmp" ] || rm -rf "$apt_tmp"' EXIT

fetch() {
    local archive uri key
    archive=$(debian_archive)
    [ -n "$archive" ] || die "no Debian archive found in this machine's apt sources"
    uri=${archive% *}
    key=${archive#* }
    [ "$key" != - ] || key=/usr/share/keyrings/debian-archive-keyring.gpg
    apt_tmp=$(mktemp -d)
    mkdir -p "$apt_tmp/parts" "$apt_tmp/lists/partial" "$apt_tmp/cache/archives/partial"
    echo "deb [signed-by=$key] $uri $suite main" >"$apt_tmp/sources.list"
    local opts=(
        -o "Dir::Etc::sourcelist=$apt_tmp/sources.list"
        -o "Dir::Etc::sourceparts=$apt_tmp/parts"
        -o "Dir::State::Lists=$apt_tmp/lists"
        -o "Dir::Cache=$apt_tmp/cache"
        -o "Acquire::Languages=none"
    )
    [ "$(id -u)" != 0 ] || opts+=(-o "APT::Sandbox::User=root")
    step "fetching the package list of $suite (private apt configuration in $apt_tmp)"
    apt-get "${opts[@]}" update -qq || die "apt-get update of $suite failed"
    if [ -z "$version" ]; then
        version=$(apt-cache "${opts[@]}" policy "$package" | awk '/Candidate:/ { print $2 }')
        [ -n "$version" ] && [ "$version" != "(none)" ] || die "$suite has no $package"
    fi
    step "downloading $package $version"
    (cd "$cache" && apt-get "${opts[@]}" download -qq "$package=$version") ||
        die "cannot download $package $version from $suite"
}

deb=$(cached_deb)
if [ -z "$deb" ]; then
    fetch
    deb=$(cached_deb)
    [ -n "$deb" ] || die "the download left no ${package}_${version}_all.deb in $cache"
fi
version=${deb##*/${package}_}; version=${version%_all.deb}
step "source: $package $version ($deb)"

# --- a fresh tree, patched ------------------------------------------------------------------

tarball=$cache/${package}_${version}.tar.xz
if [ ! -e "$tarball" ]; then
    step "extracting the source tarball from the package"
    dpkg-deb --fsys-tarfile "$deb" | tar -xO "./usr/src/$package.tar.xz" >"$tarball.part"
    mv "$tarball.part" "$tarball"
fi
step "unpacking a fresh tree into $tree_root"
rm -rf "$tree_root"
mkdir -p "$tree_root"
tar -xJf "$tarball" -C "$tree_root"
tree=$tree_root/$package
[ -f "$tree/Makefile" ] || die "the tarball has no $package/Makefile"
kernel=$(make -s -C "$tree" kernelversion 2>/dev/null || echo "?")
step "kernel $kernel"

patches=("$here"/[0-9][0-9][0-9][0-9]-*.patch)
[ -e "${patches[0]}" ] || die "no patches in $here"
for p in "${patches[@]}"; do
    name=${p##*/}
    if ! out=$(patch -d "$tree" -p1 --forward --batch --no-backup-if-mismatch <"$p" 2>&1); then
        echo "$out" >&2
        die "patch $name does not apply to $package $version (kernel $kernel); try --version with the version the series was made for (README.md)"
    fi
    step "applied $name"
done
if find "$tree" -name '*.rej' -print -quit | grep -q .; then
    die "rejected hunks left in the tree (*.rej)"
fi

if [ "$apply_only" = 1 ]; then
    step "done: ${#patches[@]} patches apply to $package $version; tree: $tree"
    exit 0
fi

# --- configure ------------------------------------------------------------------------------

step "configuring: tinyconfig + guest-patches/config (build dir $build)"
rm -rf "$build"
mkdir -p "$build"
: >"$log"
make -C "$tree" O="$build" tinyconfig >>"$log" 2>&1 || die "make tinyconfig failed (see $log)"
"$tree/scripts/kconfig/merge_config.sh" -m -O "$build" "$build/.config" "$here/config" >>"$log" 2>&1 ||
    die "merging the config fragment failed (see $log)"
make -C "$tree" O="$build" olddefconfig >>"$log" 2>&1 || die "make olddefconfig failed (see $log)"
# Every option the fragment sets must have survived: Kconfig drops what it cannot satisfy.
lost=()
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*) grep -qxF "$line" "$build/.config" || lost+=("$line") ;;
        "# CONFIG_"*" is not set") grep -qxF "$line" "$build/.config" || lost+=("$line") ;;
    esac
done <"$here/config"
[ ${#lost[@]} -eq 0 ] || die "the config lost options of the fragment: ${lost[*]}"

# --- compile --------------------------------------------------------------------------------

step "compiling bzImage with $jobs jobs (log: $log)"
if ! make -C "$tree" O="$build" -j"$jobs" bzImage >>"$log" 2>&1; then
    grep -E 'error|Error' "$log" | head -n 20 >&2 || true
    tail -n 20 "$log" >&2
    die "the kernel did not compile (see $log)"
fi
# --- every patched file compiled ------------------------------------------------------------

# A C file the config does not build proves nothing: each one the series changes must be a
# source or a dependency (an #included .c, like kernel/sched/psi.c) of an object file here.
mapfile -t changed < <(sed -n 's|^+++ b/\(.*\.[ch]\)$|\1|p' "${patches[@]}" | sort -u)
# No warnings in them either.
for f in "${changed[@]}"; do
    if grep -F "$tree/$f:" "$log" | grep -F ': warning:' >&2; then
        die "$f compiled with warnings (above)"
    fi
done
for f in "${changed[@]}"; do
    pattern=$(printf '%s' "$tree/$f" | sed 's/[][\.*^$()+?{}|]/\\&/g')
    objs=$(grep -rlE --include='.*.o.cmd' "(^| )$pattern( |$)" "$build" 2>/dev/null |
        while read -r cmd; do
            b=$(basename "$cmd" .cmd)
            o=$(dirname "$cmd")/${b#.}
            if [ -e "$o" ] && [ "$o" -nt "$tree/$f" ]; then echo "${o#"$build"/}"; fi
        done | sort -u)
    count=$(printf '%s' "$objs" | grep -c . || true)
    case "$f" in
        *.c)
            [ "$count" -gt 0 ] || die "$f is patched but this config does not compile it"
            step "compiled: $f -> $(echo "$objs" | head -n1)"
            ;;
        *.h)
            [ "$count" -gt 0 ] || die "$f is patched but nothing this config compiles includes it"
            step "included: $f (by $count objects)"
            ;;
    esac
done

step "done: $package $version with ${#patches[@]} patches"
echo "  bzImage: $build/arch/x86/boot/bzImage"
echo "  vmlinux: $build/vmlinux"
echo "  config:  $build/.config"
echo "  time:    $((SECONDS - started)) s"
