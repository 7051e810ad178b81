package sandbox

// UsageReader is a backend that can say what a sandbox uses now (shoal
// top, the dashboard). Usage reads counters only: it neither waits on the
// sandbox's agent nor resumes a paused sandbox, and is safe to call
// concurrently with anything else on the handle.
type UsageReader interface {
	Usage(h Handle) Usage
}

// Usage is a sandbox's resource use; a field is -1 when the backend could
// not read it.
type Usage struct {
	// MemoryBytes: memory charged to the sandbox now (page cache included).
	MemoryBytes int64
	// CPUUsec: CPU time its processes used, cumulative, in microseconds.
	CPUUsec int64
}
