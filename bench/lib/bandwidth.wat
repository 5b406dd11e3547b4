;; Memory bandwidth inside wasm: sum(ptr, bytes) reads [ptr, ptr + bytes) as f32x4 vectors
;; (four independent accumulators, 64 bytes per iteration) and returns the sum, so the reads
;; cannot be optimised away; sum4(ptr, bytes) reads the four quarters of the range side by side
;; (bytes a multiple of 256), 64 bytes of each per iteration: several sequential reads at once
;; keep more of memory's lines in flight than one, as onnx-generate's decoding kernels do. The
;; memory is imported (shared, so several workers can read disjoint parts of one buffer at once).
(module
  (import "env" "memory" (memory 1 65536 shared))
  (func (export "sum") (param $p i32) (param $n i32) (result f32)
    (local $end i32) (local $a v128) (local $b v128) (local $c v128) (local $d v128)
    (local.set $end (i32.add (local.get $p) (local.get $n)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $p) (local.get $end)))
        (local.set $a (f32x4.add (local.get $a) (v128.load offset=0 (local.get $p))))
        (local.set $b (f32x4.add (local.get $b) (v128.load offset=16 (local.get $p))))
        (local.set $c (f32x4.add (local.get $c) (v128.load offset=32 (local.get $p))))
        (local.set $d (f32x4.add (local.get $d) (v128.load offset=48 (local.get $p))))
        (local.set $p (i32.add (local.get $p) (i32.const 64)))
        (br $next)))
    (local.set $a (f32x4.add (f32x4.add (local.get $a) (local.get $b))
                             (f32x4.add (local.get $c) (local.get $d))))
    (f32.add
      (f32.add (f32x4.extract_lane 0 (local.get $a)) (f32x4.extract_lane 1 (local.get $a)))
      (f32.add (f32x4.extract_lane 2 (local.get $a)) (f32x4.extract_lane 3 (local.get $a)))))
  (func (export "sum4") (param $p i32) (param $n i32) (result f32)
    (local $end i32) (local $q1 i32) (local $q2 i32) (local $q3 i32)
    (local $a v128) (local $b v128) (local $c v128) (local $d v128)
    (local.set $q1 (i32.shr_u (local.get $n) (i32.const 2)))
    (local.set $q2 (i32.shl (local.get $q1) (i32.const 1)))
    (local.set $q3 (i32.add (local.get $q2) (local.get $q1)))
    (local.set $end (i32.add (local.get $p) (local.get $q1)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $p) (local.get $end)))
        (local.set $a (f32x4.add (local.get $a) (v128.load offset=0 (local.get $p))))
        (local.set $b (f32x4.add (local.get $b) (v128.load offset=16 (local.get $p))))
        (local.set $c (f32x4.add (local.get $c) (v128.load offset=32 (local.get $p))))
        (local.set $d (f32x4.add (local.get $d) (v128.load offset=48 (local.get $p))))
        (local.set $a (f32x4.add (local.get $a) (v128.load offset=0 (i32.add (local.get $p) (local.get $q1)))))
        (local.set $b (f32x4.add (local.get $b) (v128.load offset=16 (i32.add (local.get $p) (local.get $q1)))))
        (local.set $c (f32x4.add (local.get $c) (v128.load offset=32 (i32.add (local.get $p) (local.get $q1)))))
        (local.set $d (f32x4.add (local.get $d) (v128.load offset=48 (i32.add (local.get $p) (local.get $q1)))))
        (local.set $a (f32x4.add (local.get $a) (v128.load offset=0 (i32.add (local.get $p) (local.get $q2)))))
        (local.set $b (f32x4.add (local.get $b) (v128.load offset=16 (i32.add (local.get $p) (local.get $q2)))))
        (local.set $c (f32x4.add (local.get $c) (v128.load offset=32 (i32.add (local.get $p) (local.get $q2)))))
        (local.set $d (f32x4.add (local.get $d) (v128.load offset=48 (i32.add (local.get $p) (local.get $q2)))))
        (local.set $a (f32x4.add (local.get $a) (v128.load offset=0 (i32.add (local.get $p) (local.get $q3)))))
        (local.set $b (f32x4.add (local.get $b) (v128.load offset=16 (i32.add (local.get $p) (local.get $q3)))))
        (local.set $c (f32x4.add (local.get $c) (v128.load offset=32 (i32.add (local.get $p) (local.get $q3)))))
        (local.set $d (f32x4.add (local.get $d) (v128.load offset=48 (i32.add (local.get $p) (local.get $q3)))))
        (local.set $p (i32.add (local.get $p) (i32.const 64)))
        (br $next)))
    (local.set $a (f32x4.add (f32x4.add (local.get $a) (local.get $b))
                             (f32x4.add (local.get $c) (local.get $d))))
    (f32.add
      (f32.add (f32x4.extract_lane 0 (local.get $a)) (f32x4.extract_lane 1 (local.get $a)))
      (f32.add (f32x4.extract_lane 2 (local.get $a)) (f32x4.extract_lane 3 (local.get $a))))))
