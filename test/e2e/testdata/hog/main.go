// Command hog allocates and touches memory in steps of 8 MiB until it has
// the number of MiB given as its argument, printing its progress, then
// exits 0. The e2e tests use it to hit a sandbox's memory limit.
package main

import (
	"fmt"
	"os"
	"strconv"
)

func main() {
	mib, _ := strconv.Atoi(os.Args[1])
	var keep [][]byte
	for got := 0; got < mib; got += 8 {
		b := make([]byte, 8<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		keep = append(keep, b)
		fmt.Println(got + 8)
	}
	fmt.Println("done", len(keep))
}
