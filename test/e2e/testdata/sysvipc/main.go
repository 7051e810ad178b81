// Command sysvipc makes one SysV shared memory segment, one semaphore set
// and one message queue (each with IPC_PRIVATE, so they outlive it until
// removed) and prints their ids: the e2e tests check that a reset removes
// them.
package main

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	shm, err := unix.SysvShmGet(unix.IPC_PRIVATE, 4096, unix.IPC_CREAT|0o600)
	if err != nil {
		fmt.Fprintln(os.Stderr, "shmget:", err)
		os.Exit(1)
	}
	sem, _, e := unix.Syscall(unix.SYS_SEMGET, unix.IPC_PRIVATE, 1, unix.IPC_CREAT|0o600)
	if e != 0 {
		fmt.Fprintln(os.Stderr, "semget:", e)
		os.Exit(1)
	}
	msg, _, e := unix.Syscall(unix.SYS_MSGGET, unix.IPC_PRIVATE, unix.IPC_CREAT|0o600, 0)
	if e != 0 {
		fmt.Fprintln(os.Stderr, "msgget:", e)
		os.Exit(1)
	}
	fmt.Println(shm, sem, msg)
}
