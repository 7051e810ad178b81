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
