/* Host-memory block copies for the portable CPU-tier worker, with non-temporal stores.
 *
 * A scattered KV block copy is many pieces of 16 KiB to a few MiB. glibc's memmove streams
 * (non-temporal stores, no read-for-ownership of the destination) only above a threshold of
 * about three quarters of the last-level cache (20 MiB on the Xeon this was measured on), so
 * every piece of a block copy goes through the cache and moves each destination line twice:
 * 0.55-0.6x a single large memmove of the same bytes. Streaming each piece with 64-byte
 * non-temporal stores, four read streams at a time, brings that to 0.8-1.2x (docs/performance.md,
 * benchmark 4). The host
 * pool is not read again soon after a store, and a load's blocks are more than the cache holds,
 * so bypassing the cache costs nothing there.
 *
 * copy_pieces(dst, src, sizes, stream_min): three buffers of uint64 (destination addresses,
 * source addresses, byte counts), one entry per piece; pieces of at least stream_min bytes are
 * streamed when the CPU has AVX-512F (STREAMS, the AVX-512 loop), the others and every piece
 * elsewhere are copied with memmove (the plain loop). A negative stream_min streams no piece: the
 * plain loop on any CPU, which is how the caller forces it (KVCOMPOSE_COPY_LOOP=plain). The GIL
 * is released for the copy, so a copy thread leaves the engine's thread free. The addresses are
 * trusted: the caller checks the block ids they come from. Returns how many pieces were streamed
 * (0: the plain loop copied them all). Pieces must not overlap each other; within a piece,
 * memmove semantics hold on both loops (a piece whose source and destination overlap is never
 * streamed: the streamed loop writes a span before it has read the end of the one below it, so
 * it is no memmove in either direction).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVC_STREAMING 1
#else
#define KVC_STREAMING 0
#endif

static int streams = 0; /* decided once, at import */

#if KVC_STREAMING
#define SPAN 4096 /* one of the four spans copied in lockstep (a page) */

/* 16 KiB as four 4 KiB spans in lockstep, four lines of each at a time, as glibc's large
 * memmove does above its threshold: four read streams in flight instead of one. Pieces of 256 KiB
 * and up copy 8-17 % faster than one stream (9.2-11.1 against 8.5-9.5 GB/s, one 64 MiB memmove
 * 8.6-10.0 in the same runs); with the prefetch kept inside the piece, 16 KiB pieces gain too
 * (docs/performance.md, benchmark 4). d is 64-byte aligned. */
__attribute__((target("avx512f"))) static void stream_16k(char *d, const char *s, int prefetch)
{
    for (size_t j = 0; j < SPAN; j += 256) {
        for (int p = 0; p < 4; p++) {
            const char *sp = s + p * SPAN + j;
            char *dp = d + p * SPAN + j;
            if (prefetch) /* the next 16 KiB, only when it is this piece's: a scattered piece's
                             neighbour is another block, and reading it would waste bandwidth */
                for (int k = 0; k < 256; k += 64)
                    _mm_prefetch(sp + 4 * SPAN + k, _MM_HINT_T0);
            __m512i v0 = _mm512_loadu_si512((const void *)sp);
            __m512i v1 = _mm512_loadu_si512((const void *)(sp + 64));
            __m512i v2 = _mm512_loadu_si512((const void *)(sp + 128));
            __m512i v3 = _mm512_loadu_si512((const void *)(sp + 192));
            _mm512_stream_si512((void *)dp, v0);
            _mm512_stream_si512((void *)(dp + 64), v1);
            _mm512_stream_si512((void *)(dp + 128), v2);
            _mm512_stream_si512((void *)(dp + 192), v3);
        }
    }
}

__attribute__((target("avx512f"))) static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (64 - ((uintptr_t)d & 63)) & 63; /* streamed stores want aligned lines */
    if (head > n)
        head = n;
    if (head) {
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
    }
    size_t i = 0;
    for (; i + 4 * SPAN <= n; i += 4 * SPAN)
        stream_16k(d + i, s + i, i + 8 * SPAN <= n);
    for (; i + 512 <= n; i += 512) {
        if (i + 2048 + 512 <= n)
            for (int k = 0; k < 512; k += 64)
                _mm_prefetch(s + i + 2048 + k, _MM_HINT_T0);
        __m512i v0 = _mm512_loadu_si512((const void *)(s + i));
        __m512i v1 = _mm512_loadu_si512((const void *)(s + i + 64));
        __m512i v2 = _mm512_loadu_si512((const void *)(s + i + 128));
        __m512i v3 = _mm512_loadu_si512((const void *)(s + i + 192));
        __m512i v4 = _mm512_loadu_si512((const void *)(s + i + 256));
        __m512i v5 = _mm512_loadu_si512((const void *)(s + i + 320));
        __m512i v6 = _mm512_loadu_si512((const void *)(s + i + 384));
        __m512i v7 = _mm512_loadu_si512((const void *)(s + i + 448));
        _mm512_stream_si512((void *)(d + i), v0);
        _mm512_stream_si512((void *)(d + i + 64), v1);
        _mm512_stream_si512((void *)(d + i + 128), v2);
        _mm512_stream_si512((void *)(d + i + 192), v3);
        _mm512_stream_si512((void *)(d + i + 256), v4);
        _mm512_stream_si512((void *)(d + i + 320), v5);
        _mm512_stream_si512((void *)(d + i + 384), v6);
        _mm512_stream_si512((void *)(d + i + 448), v7);
    }
    if (i < n)
        memcpy(d + i, s + i, n - i);
}
#endif

/* Whether a piece's source and destination share a byte (then only memmove copies it right). */
static inline int overlaps(uint64_t d, uint64_t s, uint64_t n)
{
    return d < s + n && s < d + n;
}

static int uint64_buffer(Py_buffer *b, const char *what)
{
    if (b->len % 8) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: %s is %zd bytes, not whole uint64 entries", what, b->len);
        return 0;
    }
    return 1;
}

static PyObject *copy_pieces(PyObject *self, PyObject *args)
{
    Py_buffer dst, src, sizes;
    Py_ssize_t stream_min;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &dst, &src, &sizes, &stream_min))
        return NULL;
    PyObject *result = NULL;
    if (!uint64_buffer(&dst, "dst") || !uint64_buffer(&src, "src") || !uint64_buffer(&sizes, "sizes"))
        goto done;
    if (dst.len != sizes.len || src.len != sizes.len) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: %zd destinations and %zd sources for %zd sizes", dst.len / 8,
                     src.len / 8, sizes.len / 8);
        goto done;
    }
    const uint64_t *d = dst.buf, *s = src.buf, *n = sizes.buf;
    size_t count = (size_t)sizes.len / 8;
    size_t min = stream_min < 0 ? SIZE_MAX : (size_t)stream_min;
    size_t streamed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t k = 0; k < count; k++) {
#if KVC_STREAMING
        if (streams && n[k] >= min && !overlaps(d[k], s[k], n[k])) {
            stream_copy((char *)(uintptr_t)d[k], (const char *)(uintptr_t)s[k], (size_t)n[k]);
            streamed++;
            continue;
        }
#endif
        memmove((void *)(uintptr_t)d[k], (const void *)(uintptr_t)s[k], (size_t)n[k]);
    }
#if KVC_STREAMING
    if (streamed)
        _mm_sfence(); /* streamed lines are visible before the copy is reported done */
#endif
    Py_END_ALLOW_THREADS
    result = PyLong_FromSize_t(streamed);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_pieces", copy_pieces, METH_VARARGS,
     "copy_pieces(dst, src, sizes, stream_min): copy each piece; stream those of at least stream_min bytes "
     "(none if negative). Returns how many were streamed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_streamcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
#if KVC_STREAMING
    __builtin_cpu_init();
    streams = __builtin_cpu_supports("avx512f") != 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "STREAMS", streams) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
