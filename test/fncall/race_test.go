//go:build race

package fncall

// Under -race the server is built with the race detector too, and a data
// race it reports fails the run.
func init() { raceBuild = true }
