#!/usr/bin/env bash
# Build, sign and verify a bundle from a model repository, then publish it with its sha256.
#
#   ota/recipes/build-and-publish.sh --repo models --name vision --version 7 \
#       --key /secure/fleet-2025.key --trust fleet-trust/ --publish /srv/bundles \
#       [--checks ota/recipes/checks-mlp.json] [--model mlp ...] [--arch aarch64 ...] \
#       [--accelerator cuda ...] [--expires 30d] [--security-version N] [--no-gzip]
#
# --trust is the folder of public keys the devices trust (the same *.pub files as their
# <state_dir>/trust/): the bundle is verified against it before anything is published, so a bundle
# signed with a key the fleet does not trust never leaves this host. A published file is never
# overwritten: bundle versions are immutable (devices refuse a version they already have).
#
# Output: <publish>/<name>-v<version>.esb and <publish>/<name>-v<version>.esb.sha256 (sha256sum
# format); the last line printed is the sha256. EDGESERVE=/path/to/edgeserve picks the CLI.
set -euo pipefail

usage() {
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

die() {
    echo "build-and-publish: $*" >&2
    exit 1
}

edgeserve=${EDGESERVE:-edgeserve}
repo="" name="" version="" key="" trust="" publish=""
extra=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        --repo) repo=${2:?--repo needs a folder}; shift 2 ;;
        --name) name=${2:?--name needs a bundle name}; shift 2 ;;
        --version) version=${2:?--version needs a number}; shift 2 ;;
        --key) key=${2:?--key needs a private key file}; shift 2 ;;
        --trust) trust=${2:?--trust needs a folder of *.pub}; shift 2 ;;
        --publish) publish=${2:?--publish needs a folder}; shift 2 ;;
        --checks | --model | --arch | --accelerator | --expires | --security-version)
            extra+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        --no-gzip) extra+=("$1"); shift ;;
        -h | --help) usage ;;
        *) echo "build-and-publish: unknown argument $1" >&2; usage ;;
    esac
done

[[ -n $repo && -n $name && -n $version && -n $key && -n $trust && -n $publish ]] || usage
[[ $version =~ ^[1-9][0-9]*$ ]] || die "--version must be a positive integer, not '$version'"
[[ -d $repo ]] || die "no model repository folder $repo"
[[ -f $key ]] || die "no private key $key"
compgen -G "$trust/*.pub" >/dev/null || die "no *.pub in $trust: every device would refuse the bundle"
command -v "$edgeserve" >/dev/null || die "$edgeserve not found (set EDGESERVE=/path/to/edgeserve)"

file="$name-v$version.esb"
target="$publish/$file"
[[ ! -e $target ]] || die "$target exists: bundle versions are immutable, build v$((version + 1)) instead"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$edgeserve" bundle build "$repo" --name "$name" --version "$version" --key "$key" \
    --out "$work/$file" "${extra[@]}"
# Signature against the fleet's trusted keys, the manifest, and every file's size and sha256.
"$edgeserve" bundle verify "$work/$file" --trust "$trust"

sha=$(sha256sum "$work/$file" | cut -d' ' -f1)
mkdir -p "$publish"
# Copy under a temporary name and rename: a device never downloads half a file under the real name.
cp "$work/$file" "$publish/.$file.tmp"
mv "$publish/.$file.tmp" "$target"
echo "$sha  $file" >"$target.sha256"

echo "published $target ($(stat -c %s "$target") bytes)"
echo "install on a device: edgeserve bundle install <URL of $file> --sha256 $sha"
echo "$sha"
