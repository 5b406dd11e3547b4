// Chromium's renderer processes among this process's descendants (Linux /proc): their peak
// resident memory (VmHWM) and CPU time. The benchmark starts one browser per run, so the
// renderers found are that run's.
import { readdirSync, readFileSync } from "node:fs";

function read(path) {
  try {
    return readFileSync(path, "utf8");
  } catch {
    return null; // the process ended meanwhile
  }
}

/** PIDs of the renderer processes below this process. */
function renderers() {
  const parent = new Map();
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    const stat = read(`/proc/${name}/stat`);
    if (!stat) continue;
    // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    parent.set(Number(name), Number(fields[1]));
  }
  const below = (pid) => {
    for (let p = parent.get(pid); p; p = parent.get(p)) if (p === process.pid) return true;
    return false;
  };
  return [...parent.keys()].filter(
    (pid) => below(pid) && (read(`/proc/${pid}/cmdline`) || "").includes("--type=renderer"),
  );
}

/** The largest peak RSS (VmHWM) of the renderers, in MB (2^20 bytes). */
export function peakOfRenderers() {
  let peak = 0;
  for (const pid of renderers()) {
    const m = /VmHWM:\s+(\d+) kB/.exec(read(`/proc/${pid}/status`) || "");
    if (m) peak = Math.max(peak, Number(m[1]) / 1024);
  }
  if (peak === 0) throw new Error("no Chromium renderer process found to read its peak memory");
  return peak;
}

/** User + system CPU seconds of the renderers (all their threads). */
export function rendererCpuSeconds() {
  let ticks = 0;
  for (const pid of renderers()) {
    const stat = read(`/proc/${pid}/stat`);
    if (!stat) continue;
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    ticks += Number(fields[11]) + Number(fields[12]); // utime, stime (fields 14 and 15)
  }
  return ticks / 100; // USER_HZ
}
