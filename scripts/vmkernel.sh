#!/usr/bin/env bash
# Fetches the guest kernel of the microvm backend from Debian's archive and
# extracts it (never installed as the host's kernel):
#
#   scripts/vmkernel.sh [DIR]        default DIR: /usr/local/lib/shoal/vm
#
# DIR/vmlinux (uncompressed, booted via PVH) and DIR/vmlinuz are the kernel of linux-image-cloud-amd64 (Debian 12's cloud
# flavour: virtio, ext4, tmpfs, devtmpfs, PVH built in), DIR/modules/ the
# few modules the guest loads itself (virtio transport, block and console,
# balloon, EROFS and overlayfs) and DIR/modules/order their load order;
# DIR/modules/order.pmem lists the persistent-memory modules (libnvdimm,
# nd_pmem, nd_e820) a guest with pmem layers loads after them, and
# DIR/modules/order.net those of a guest with network egress (virtio_net),
# DIR/modules/order.pci the virtio PCI transport (loaded where virtio
# devices are on PCI: fullvm's q35).
# `shoal serve` builds each guest's initramfs from these and its shoal-agent.
# Running it again replaces DIR's content with the archive's current kernel.
set -euo pipefail
dest=${1:-/usr/local/lib/shoal/vm}
# The versioned package behind the metapackage (linux-image-6.1.0-N-cloud-amd64).
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
	echo "vmkernel: apt knows no linux-image-cloud-amd64 (run apt-get update)" >&2
	exit 1
fi
tmp=$(mktemp -d /tmp/shoal-vmkernel.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp" # apt-get download runs as _apt when it can
(cd "$tmp" && apt-get download -qq "$pkg" 2>/dev/null) || (cd "$tmp" && apt-get download "$pkg")
dpkg-deb -x "$tmp"/*.deb "$tmp/x"
kver=$(ls "$tmp/x/lib/modules")
mods="$tmp/x/lib/modules/$kver/kernel"
# In dependency order (modinfo -F depends of each: virtio_ring <- virtio <-
# the transports and drivers; libcrc32c <- erofs; crc32c is built in).
order="virtio_ring virtio virtio_mmio virtio_blk virtio_console virtio_balloon
libcrc32c erofs overlay"
# The virtio PCI transport: loaded after them, only by a guest with virtio
# devices on PCI (fullvm's q35; a microvm's devices are virtio-mmio).
pci_order="virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci"
# Loaded only by a guest whose layers are persistent memory (the microvm
# backend's pmem layers: legacy e820 pmem regions, DAX), after the others.
pmem_order="libnvdimm nd_btt nd_pmem nd_e820"
# Loaded only by a guest with network egress (a virtio-net device on a tap).
net_order="failover net_failover virtio_net"
new="$dest.new.$$"
rm -rf "$new"
mkdir -p "$new/modules"
cp "$tmp/x/boot/vmlinuz-$kver" "$new/vmlinuz"
# The uncompressed kernel (an ELF with a PVH entry point, which QEMU boots
# directly): no decompression at each boot, seconds under TCG. The bzImage
# carries it LZ4-compressed (CONFIG_KERNEL_LZ4) after the setup code.
if command -v lz4 >/dev/null; then
	off=$(grep -abo $'\x02\x21\x4c\x18' "$new/vmlinuz" | head -1 | cut -d: -f1 || true)
	if [ -n "$off" ] && tail -c +$((off + 1)) "$new/vmlinuz" | lz4 -dc >"$new/vmlinux" 2>/dev/null; [ -s "$new/vmlinux" ] &&
		head -c 4 "$new/vmlinux" | grep -q ELF; then
		:
	else
		echo "vmkernel: could not extract vmlinux; guests boot the compressed vmlinuz" >&2
		rm -f "$new/vmlinux"
	fi
fi
cp "$tmp/x/boot/config-$kver" "$new/config"
# modules LIST WHY MODULES...: copies the modules into DIR/modules and lists
# them in DIR/modules/LIST. When the package lacks one, an empty WHY stops
# the script; otherwise the list is left out, saying WHY (what guests then
# go without).
modules() {
	local list=$1 why=$2 m f
	shift 2
	for m in "$@"; do
		f=$(find "$mods" -name "$m.ko" | head -1)
		if [ -z "$f" ]; then
			if [ -z "$why" ]; then
				echo "vmkernel: $pkg has no module $m" >&2
				exit 1
			fi
			echo "vmkernel: $pkg has no module $m: $why" >&2
			rm -f "$new/modules/$list"
			return
		fi
		cp "$f" "$new/modules/"
		echo "$m.ko" >>"$new/modules/$list"
	done
}
modules order "" $order
modules order.pci "" $pci_order
modules order.pmem "guests' layers stay block devices" $pmem_order
modules order.net "no network egress for VMs" $net_order
echo "$pkg $kver" >"$new/version"
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.old"
[ -e "$dest" ] && mv "$dest" "$dest.old"
mv "$new" "$dest"
rm -rf "$dest.old"
echo "vmkernel: $pkg ($kver) in $dest"
