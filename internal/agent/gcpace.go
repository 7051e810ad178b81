package agent

import (
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
)

// PaceGCByGrowth makes the Go runtime collect when the agent's memory
// grows, and never because time passed.
//
// Besides GOGC's growth trigger, the runtime collects whenever two minutes
// went by without a collection (forcegcperiod). An agent spends most of
// its life frozen (a paused sandbox) with its memory paged out, so that
// collection came right after a thaw, walking the whole heap and reading
// each page of it back in from swap while the request that resumed the
// sandbox waited. The runtime has no setting for that period; it skips
// it when GOGC is off. So GOGC is off, and the memory limit plays its
// part: after each collection it is set to the memory the runtime holds
// in use then plus as much as the live heap (at least minGrowth):
// GOGC=100's rule, counted on all of the runtime's memory rather than the
// heap alone.
// The idle release (Config.IdleRelease) still collects and returns free
// memory once the agent has nothing to do.
//
// $GOGC or $GOMEMLIMIT in the agent's environment leave the runtime's
// own pacing as it is.
func PaceGCByGrowth() {
	if envSet("GOGC") || envSet("GOMEMLIMIT") {
		return
	}
	debug.SetGCPercent(-1)
	setGrowthLimit()
	armGCHook()
}

// minGrowth is the least the memory limit is above the runtime's memory
// after a collection (GOGC's minimum heap goal is 4 MiB).
const minGrowth = 4 << 20

// setGrowthLimit sets the memory limit to the runtime's memory in use
// with a heap of live objects only (all it mapped but what it released,
// its free heap pages, which the limit makes it release when need be, and
// the objects allocated since the last mark), plus the live heap again,
// at least minGrowth.
func setGrowthLimit() {
	s := []metrics.Sample{
		{Name: "/memory/classes/total:bytes"},
		{Name: "/memory/classes/heap/released:bytes"},
		{Name: "/memory/classes/heap/free:bytes"},
		{Name: "/memory/classes/heap/objects:bytes"},
		{Name: "/gc/heap/live:bytes"},
	}
	metrics.Read(s)
	total, released, free := s[0].Value.Uint64(), s[1].Value.Uint64(), s[2].Value.Uint64()
	objects, live := s[3].Value.Uint64(), s[4].Value.Uint64()
	inUse := int64(total-released-free) - int64(objects) + int64(live)
	debug.SetMemoryLimit(inUse + int64(max(live, minGrowth)))
}

// gcHook is allocated so that its finalizer runs after each collection
// (an object of its own size class: tiny objects share blocks, and their
// finalizers may never run).
type gcHook struct{ _ [64]byte }

func armGCHook() {
	runtime.SetFinalizer(&gcHook{}, func(*gcHook) {
		setGrowthLimit()
		armGCHook()
	})
}

func envSet(name string) bool {
	_, ok := os.LookupEnv(name)
	return ok
}
