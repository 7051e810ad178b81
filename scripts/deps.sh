# Sourced by scripts/up, scripts/test and .ci/run: installs what Shoal needs
# from Debian's archive and makes sure a Go toolchain new enough for go.mod
# is on PATH (through the Go module proxy's toolchain download if needed).
install_deps() {
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends \
		runc erofs-utils e2fsprogs busybox-static debootstrap ca-certificates \
		python3 python3-httpx python3-pytest python3-pip python3-venv python3-setuptools zstd iproute2 procps curl kmod util-linux \
		qemu-system-x86 qemu-utils cpio lz4 chromium docker-registry >/dev/null
}

# The microvm backend's guest kernel, from Debian's archive (not installed as
# the host's kernel): scripts/vmkernel.sh puts it in /usr/local/lib/shoal/vm.
install_vm_kernel() {
	[ -s /usr/local/lib/shoal/vm/version ] && [ -s /usr/local/lib/shoal/vm/modules/order.pmem ] && [ -s /usr/local/lib/shoal/vm/modules/order.net ] && [ -s /usr/local/lib/shoal/vm/modules/order.pci ] && grep -q "$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')" /usr/local/lib/shoal/vm/version && return 0
	"$(dirname "${BASH_SOURCE[0]}")/vmkernel.sh" /usr/local/lib/shoal/vm
}

ensure_go() {
	export PATH="/usr/local/go/bin:$PATH"
	if ! command -v go >/dev/null || ! go version | grep -Eq 'go1\.(2[2-9]|[3-9][0-9])'; then
		# Debian 12's own Go (1.19) is too old; bookworm-backports carries a
		# newer one, which fetches the toolchain go.mod names by itself.
		echo "deb http://deb.debian.org/debian bookworm-backports main" >/etc/apt/sources.list.d/shoal-backports.list
		apt-get update -qq
		apt-get install -y -qq -t bookworm-backports golang-1.23-go >/dev/null
		export PATH="/usr/lib/go-1.23/bin:$PATH"
	fi
	export GOTOOLCHAIN=auto
	go version
}

build_shoal() {
	mkdir -p bin
	# shoal-server is the whole binary; shoal the CLI alone (-tags client:
	# none of the server's packages, a fifth of the start-up time), whose
	# serve and bench execute shoal-server beside it.
	go build -o bin/shoal-server ./cmd/shoal
	go build -tags client -o bin/shoal ./cmd/shoal
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o bin/shoal-agent ./cmd/shoal-agent
}

# The stock e2b SDK from npm that the E2B compatibility tests (test/e2b)
# drive Shoal with, pinned in test/e2b/package-lock.json (`npm ci`); it
# needs Node.js >= 20.18.1 (Debian 12's own is older). Used by .ci/run and
# scripts/test; npm ci runs again only when the lock file changed since.
# Fails naming what is missing.
install_e2b_sdk() {
	local dir
	dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/test/e2b"
	if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
		echo "missing: Node.js >= 20.18.1 and npm, for the e2b SDK of test/e2b" >&2
		return 1
	fi
	if ! node -e 'const [a, b, c] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && (b > 18 || (b === 18 && c >= 1))) ? 0 : 1)'; then
		echo "missing: Node.js >= 20.18.1 for the e2b SDK of test/e2b (have $(node --version))" >&2
		return 1
	fi
	if [ -f "$dir/node_modules/e2b/package.json" ] && [ "$dir/node_modules/.package-lock.json" -nt "$dir/package-lock.json" ]; then
		return 0
	fi
	(cd "$dir" && npm ci --no-audit --no-fund) || {
		echo "npm ci in test/e2b failed (the e2b SDK, from registry.npmjs.org)" >&2
		return 1
	}
}

# check_test_deps fails naming what the test suites need that this host
# lacks (install_deps installs it all), so that no suite skips for want of
# a tool.
check_test_deps() {
	local missing=() c
	for c in runc mkfs.erofs dump.erofs busybox debootstrap qemu-system-x86_64 qemu-img cpio lz4 zstd ip mkfs.ext4 curl modprobe mkswap swapon chromium; do
		command -v "$c" >/dev/null || missing+=("$c")
	done
	/usr/bin/python3 -c 'import httpx, pytest, pip, venv' 2>/dev/null || missing+=("python3-httpx python3-pytest python3-pip python3-venv")
	[ -s /usr/local/lib/shoal/vm/version ] || missing+=("the VM backends' guest kernel (install_vm_kernel)")
	if [ ${#missing[@]} -gt 0 ]; then
		echo "missing: ${missing[*]} (as root: . scripts/deps.sh && install_deps, as .ci/run does)" >&2
		return 1
	fi
}
