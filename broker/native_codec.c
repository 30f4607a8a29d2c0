/* The group codec's hot paths in C (CPython C API), for tidal.broker.codec.

   codec.py is the reference: every rule here is one of its rules, and where this code meets anything
   outside the common case (an array that is not a contiguous 1-D buffer, mixed dtypes in a column, some
   samples with a loss mask and some without, a frame that breaks a rule) it returns None and the Python
   code runs instead, which builds the frame or raises the error with its message. Tests check that both
   give the same bytes, accept the same frames and decode to the same samples.

   encode(group, alloc, streaming) -> uint8 array (the frame), or None
   layout(buf, data_start, n, arrays, want_versions)
                                   -> (specs, prompt_lens, response_lens, rewards, vmin, vmax), or None
   inspect(buffer)                 -> inspect_group's summary (GroupInfo's fields), or None
   decode(buffer, Sample, Group)   -> decode_group's Group (layout, the sample info, column views,
                                      samples), or None
   crc32_combine(crc_a, crc_b, len_b)
                                   -> zlib.crc32(a + b)
   gather(dest, at, parts)         -> at + total bytes copied, or None where they do not fit
   address(buffer)                 -> where the buffer's bytes start in this process
   unpack(buffer)                  -> msgpack.unpackb(buffer, raw=False), or NotImplemented where this
                                      decoder leaves it to msgpack (ext types, bad UTF-8, errors)
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
/* frames are little-endian and this code copies native values: elsewhere the build fails and codec.py runs */
#error "the native group codec is for little-endian hosts"
#endif

enum { REWARDS, PROMPT_LENS, RESPONSE_LENS, SAMPLE_INFO, PROMPT_IDS, RESPONSE_IDS, LOGPROBS, VERSIONS,
       LOSS_MASK, NUM_KNOWN };
static const char *NAMES[NUM_KNOWN] = {"rewards",      "prompt_lens", "response_lens",
                                       "sample_info",  "prompt_ids",  "response_ids",
                                       "logprobs",     "versions",    "loss_mask"};
#define FIRST_COLUMN PROMPT_IDS
#define NUM_COLUMNS (NUM_KNOWN - FIRST_COLUMN) /* prompt_ids, response_ids, logprobs, versions, loss_mask */

static PyObject *name_objs[NUM_KNOWN]; /* interned names */
static PyObject *known_index;          /* {name: index} */
static PyObject *dtype_objs;           /* {"<i4": np.dtype("<i4"), ...}: the allowed dtypes */
static PyObject *np_empty, *np_uint8, *np_frombuffer, *packb;
static PyObject *s_samples, *s_group_id, *s_meta, *s_reward, *s_finish_reason, *s_id, *s_n, *s_arrays, *s_view;

/* ---- dtypes ---- */

/* The dtype string of a buffer's format, as numpy names it, if it is an allowed one; NULL otherwise. */
static const char *dtype_of(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] == '\0' || f[1] != '\0') return NULL;
    switch (f[0]) {
    case 'b': return v->itemsize == 1 ? "|i1" : NULL;
    case 'B': return v->itemsize == 1 ? "|u1" : NULL;
    case '?': return v->itemsize == 1 ? "|b1" : NULL;
    case 'h': return v->itemsize == 2 ? "<i2" : NULL;
    case 'H': return v->itemsize == 2 ? "<u2" : NULL;
    case 'i': case 'l': case 'q':
        return v->itemsize == 4 ? "<i4" : v->itemsize == 8 ? "<i8" : NULL;
    case 'e': return v->itemsize == 2 ? "<f2" : NULL;
    case 'f': return v->itemsize == 4 ? "<f4" : NULL;
    case 'd': return v->itemsize == 8 ? "<f8" : NULL;
    default: return NULL;
    }
}

static char kind_of(const char *dtype) { return dtype[1]; } /* "<i4" -> 'i', "|u1" -> 'u', "<f8" -> 'f' */
static int size_of(const char *dtype) { return dtype[2] - '0'; }

/* ---- msgpack, as msgpack-python packs these values (use_bin_type=True) ---- */

static size_t uint_size(unsigned long long x) {
    return x < 128 ? 1 : x < 256 ? 2 : x < 65536 ? 3 : x < 4294967296ULL ? 5 : 9;
}
static size_t str_size(size_t len) {
    return len + (len < 32 ? 1 : len < 256 ? 2 : len < 65536 ? 3 : 5);
}
static char *put_uint(char *p, unsigned long long x) {
    if (x < 128) { *p++ = (char)x; return p; }
    int bytes;
    if (x < 256) { *p++ = (char)0xcc; bytes = 1; }
    else if (x < 65536) { *p++ = (char)0xcd; bytes = 2; }
    else if (x < 4294967296ULL) { *p++ = (char)0xce; bytes = 4; }
    else { *p++ = (char)0xcf; bytes = 8; }
    for (int i = bytes - 1; i >= 0; i--) *p++ = (char)(x >> (8 * i));
    return p;
}
static char *put_str(char *p, const char *s, size_t len) {
    if (len < 32) *p++ = (char)(0xa0 | len);
    else if (len < 256) { *p++ = (char)0xd9; *p++ = (char)len; }
    else if (len < 65536) { *p++ = (char)0xda; *p++ = (char)(len >> 8); *p++ = (char)len; }
    else {
        *p++ = (char)0xdb;
        for (int i = 3; i >= 0; i--) *p++ = (char)(len >> (8 * i));
    }
    memcpy(p, s, len);
    return p + len;
}

/* ---- encode ---- */

static Py_ssize_t pad8(Py_ssize_t n) { return (8 - n % 8) % 8; }

/* Parts at least this long go to a streaming frame with non-temporal stores (copy_streaming). */
#define STREAM_MIN_BYTES 1024

#if defined(__SSE2__)
/* memcpy with non-temporal stores: the lines go to memory without being read into this core's cache
   first. For a frame in a submit ring: memory the node wrote laps ago and other processes read since,
   which a plain copy reads in before it writes (at 1K tokens the node's encoding cost twice what it does
   into memory in its cache), and which the node does not read again. The caller fences (_mm_sfence)
   before the frame is handed on. */
static void copy_streaming(char *dst, const char *src, size_t len) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* stores of 16 aligned bytes from here */
    if (head > len) head = len;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    for (; len >= 64; len -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, len);
}
#endif

/* Zero the padding from end to at (no stray memory on the wire), copy len bytes there; returns their end.
   Only the gaps are zeroed: a frame's memory may hold other bytes (a ring's span, a reused buffer). */
static char *put_part(char *end, char *at, const void *src, size_t len, int streaming) {
    memset(end, 0, (size_t)(at - end));
#if defined(__SSE2__)
    if (streaming && len >= STREAM_MIN_BYTES) {
        copy_streaming(at, src, len);
        return at + len;
    }
#else
    (void)streaming;
#endif
    if (len) memcpy(at, src, len);
    return at + len;
}

typedef struct {
    int present;
    const char *dtype;
    Py_ssize_t count, offset;
} Column;

/* The frame of a group, as codec.encode_group builds it; None where that code must run instead. With
   streaming, its large parts are copied with non-temporal stores (copy_streaming). */
static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *group, *alloc;
    int streaming = 0;
    if (!PyArg_ParseTuple(args, "OO|p", &group, &alloc, &streaming)) return NULL;
    PyObject *result = NULL, *samples = NULL, *gid = NULL, *meta = NULL, *meta_packed = NULL;
    PyObject *info = NULL, *reasons = NULL, *metas = NULL, *out = NULL;
    Py_buffer *views = NULL, outview = {0};
    int *have = NULL;
    double *rewards = NULL;
    int32_t *lens = NULL;
    Py_ssize_t n = 0;

    samples = PyObject_GetAttr(group, s_samples);
    gid = samples ? PyObject_GetAttr(group, s_group_id) : NULL;
    meta = gid ? PyObject_GetAttr(group, s_meta) : NULL;
    if (!meta || !PyList_CheckExact(samples) || !PyUnicode_CheckExact(gid)) goto fallback;
    n = PyList_GET_SIZE(samples);
    if (n < 1) goto fallback;
    Py_ssize_t gid_len;
    const char *gid_utf8 = PyUnicode_AsUTF8AndSize(gid, &gid_len);
    if (!gid_utf8) goto fallback;

    views = PyMem_Calloc((size_t)n * NUM_COLUMNS, sizeof(Py_buffer));
    have = PyMem_Calloc((size_t)n * NUM_COLUMNS, sizeof(int));
    rewards = PyMem_Malloc((size_t)n * sizeof(double));
    lens = PyMem_Malloc((size_t)n * 2 * sizeof(int32_t));
    reasons = PyList_New(n);
    metas = PyList_New(n);
    if (!views || !have || !rewards || !lens || !reasons || !metas) goto fallback;

    Column cols[NUM_COLUMNS] = {{0}};
    int masks = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(samples, i);
        for (int c = 0; c < NUM_COLUMNS; c++) {
            PyObject *a = PyObject_GetAttr(s, name_objs[FIRST_COLUMN + c]);
            if (!a) goto fallback;
            if (a == Py_None && FIRST_COLUMN + c == LOSS_MASK) { Py_DECREF(a); continue; }
            Py_buffer *v = &views[i * NUM_COLUMNS + c];
            int got = PyObject_GetBuffer(a, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
            Py_DECREF(a);
            if (got < 0) goto fallback;
            have[i * NUM_COLUMNS + c] = 1;
            const char *dt = dtype_of(v);
            if (v->ndim != 1 || dt == NULL) goto fallback;
            if (cols[c].dtype == NULL) {
                if (i != 0) goto fallback; /* a loss mask after samples without one */
                cols[c].dtype = dt;
            } else if (strcmp(cols[c].dtype, dt)) {
                goto fallback; /* mixed dtypes: numpy's result_type decides */
            }
            cols[c].count += v->shape[0];
            if (FIRST_COLUMN + c == LOSS_MASK) masks++;
        }
        if (masks != 0 && masks != i + 1) goto fallback; /* some masks missing: codec.py fills in ones */
        if (views[i * NUM_COLUMNS].shape[0] > INT32_MAX || views[i * NUM_COLUMNS + 1].shape[0] > INT32_MAX)
            goto fallback;
        lens[i] = (int32_t)views[i * NUM_COLUMNS].shape[0];
        lens[n + i] = (int32_t)views[i * NUM_COLUMNS + 1].shape[0];
        PyObject *r = PyObject_GetAttr(s, s_reward);
        if (!r) goto fallback;
        rewards[i] = PyFloat_AsDouble(r);
        Py_DECREF(r);
        if (rewards[i] == -1.0 && PyErr_Occurred()) goto fallback;
        PyObject *fr = PyObject_GetAttr(s, s_finish_reason);
        if (!fr) goto fallback;
        PyList_SET_ITEM(reasons, i, fr);
        PyObject *m = PyObject_GetAttr(s, s_meta);
        if (!m) goto fallback;
        PyList_SET_ITEM(metas, i, m);
    }
    for (int c = 0; c < NUM_COLUMNS; c++) cols[c].present = FIRST_COLUMN + c != LOSS_MASK || masks > 0;

    {
        PyObject *pair = PyList_New(2);
        if (!pair) goto fallback;
        Py_INCREF(reasons); PyList_SET_ITEM(pair, 0, reasons);
        Py_INCREF(metas); PyList_SET_ITEM(pair, 1, metas);
        info = PyObject_CallOneArg(packb, pair);
        Py_DECREF(pair);
    }
    meta_packed = info ? PyObject_CallOneArg(packb, meta) : NULL;
    if (!meta_packed || !PyBytes_CheckExact(info) || !PyBytes_CheckExact(meta_packed)) goto fallback;
    Py_ssize_t info_len = PyBytes_GET_SIZE(info);

    /* where everything lies in the data region */
    Py_ssize_t offsets[4], off = 0;
    offsets[0] = off; off += 8 * n;
    offsets[1] = off; off += 4 * n + pad8(4 * n);
    offsets[2] = off; off += 4 * n + pad8(4 * n);
    offsets[3] = off; off += info_len + pad8(info_len);
    int num_arrays = 4;
    for (int c = 0; c < NUM_COLUMNS; c++) {
        if (!cols[c].present) continue;
        num_arrays++;
        cols[c].offset = off;
        off += cols[c].count * size_of(cols[c].dtype);
        off += pad8(off);
    }
    const char *fixed_dtypes[4] = {"<f8", "<i4", "<i4", "|u1"};
    Py_ssize_t fixed_counts[4] = {n, n, n, info_len};

    /* the header: {"id": gid, "n": n, "meta": meta, "arrays": {name: [dtype, count, offset]}} */
    size_t hlen = 1 + str_size(2) + str_size((size_t)gid_len) + str_size(1) + uint_size((size_t)n) +
                  str_size(4) + (size_t)PyBytes_GET_SIZE(meta_packed) + str_size(6) + 1;
    for (int a = 0; a < NUM_KNOWN; a++) {
        if (a >= FIRST_COLUMN && !cols[a - FIRST_COLUMN].present) continue;
        const Column *col = a >= FIRST_COLUMN ? &cols[a - FIRST_COLUMN] : NULL;
        size_t count = (size_t)(col ? col->count : fixed_counts[a]);
        size_t offset = (size_t)(col ? col->offset : offsets[a]);
        hlen += str_size(strlen(NAMES[a])) + 1 + str_size(3) + uint_size(count) + uint_size(offset);
    }
    if (hlen > UINT32_MAX) goto fallback;
    Py_ssize_t start = 4 + (Py_ssize_t)hlen;
    start += pad8(start);
    Py_ssize_t total = start + off;

    /* from here on nothing falls back: the memory is taken */
    PyObject *size = PyLong_FromSsize_t(total);
    if (!size) goto fail;
    if (alloc == Py_None) {
        out = PyObject_CallFunctionObjArgs(np_empty, size, np_uint8, NULL);
    } else {
        PyObject *mem = PyObject_CallOneArg(alloc, size);
        out = mem ? PySequence_GetSlice(mem, 0, total) : NULL;
        Py_XDECREF(mem);
    }
    Py_DECREF(size);
    if (!out || PyObject_GetBuffer(out, &outview, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail;
    if (outview.len < total) {
        PyErr_Format(PyExc_ValueError, "the frame's memory holds %zd bytes, %zd needed", outview.len, total);
        goto fail;
    }
    char *frame = outview.buf, *p = frame + 4;
    for (int i = 0; i < 4; i++) frame[i] = (char)(hlen >> (8 * i));
    *p++ = (char)0x84;
    p = put_str(p, "id", 2);
    p = put_str(p, gid_utf8, (size_t)gid_len);
    p = put_str(p, "n", 1);
    p = put_uint(p, (unsigned long long)n);
    p = put_str(p, "meta", 4);
    memcpy(p, PyBytes_AS_STRING(meta_packed), (size_t)PyBytes_GET_SIZE(meta_packed));
    p += PyBytes_GET_SIZE(meta_packed);
    p = put_str(p, "arrays", 6);
    *p++ = (char)(0x80 | num_arrays);
    for (int a = 0; a < NUM_KNOWN; a++) {
        if (a >= FIRST_COLUMN && !cols[a - FIRST_COLUMN].present) continue;
        const Column *col = a >= FIRST_COLUMN ? &cols[a - FIRST_COLUMN] : NULL;
        p = put_str(p, NAMES[a], strlen(NAMES[a]));
        *p++ = (char)0x93;
        p = put_str(p, col ? col->dtype : fixed_dtypes[a], 3);
        p = put_uint(p, (unsigned long long)(col ? col->count : fixed_counts[a]));
        p = put_uint(p, (unsigned long long)(col ? col->offset : offsets[a]));
    }
    memset(p, 0, (size_t)(start - (p - frame)));
    char *data = frame + start;
    char *end = data;
    end = put_part(end, data + offsets[0], rewards, (size_t)n * 8, streaming);
    end = put_part(end, data + offsets[1], lens, (size_t)n * 4, streaming);
    end = put_part(end, data + offsets[2], lens + n, (size_t)n * 4, streaming);
    end = put_part(end, data + offsets[3], PyBytes_AS_STRING(info), (size_t)info_len, streaming);
    for (int c = 0; c < NUM_COLUMNS; c++) {
        if (!cols[c].present) continue;
        end = put_part(end, data + cols[c].offset, NULL, 0, streaming);
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_buffer *v = &views[i * NUM_COLUMNS + c];
            end = put_part(end, end, v->buf, (size_t)v->len, streaming);
        }
    }
    put_part(end, data + off, NULL, 0, streaming);
#if defined(__SSE2__)
    if (streaming) _mm_sfence(); /* the frame's stores are visible before anyone is told of it */
#endif
    result = out;
    out = NULL;
    goto done;

fallback:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    if (outview.obj) PyBuffer_Release(&outview);
    if (views) {
        for (Py_ssize_t i = 0; i < n * NUM_COLUMNS; i++)
            if (have[i]) PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(have);
    PyMem_Free(rewards);
    PyMem_Free(lens);
    Py_XDECREF(out);
    Py_XDECREF(info);
    Py_XDECREF(meta_packed);
    Py_XDECREF(reasons);
    Py_XDECREF(metas);
    Py_XDECREF(samples);
    Py_XDECREF(gid);
    Py_XDECREF(meta);
    return result;
}

/* ---- layout: codec._Frame's checks of the array specs and the per-sample columns ---- */

typedef struct {
    int present;
    PyObject *dtype; /* borrowed from dtype_objs */
    long long count, begin;
    int itemsize;
} Spec;

static int as_count(PyObject *o, long long *out) {
    if (!PyLong_CheckExact(o)) return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred()) || x < 0) { PyErr_Clear(); return 0; }
    *out = x;
    return 1;
}

static int load_i32(const char *p) { int32_t x; memcpy(&x, p, 4); return x; }

/* The least and greatest entry of an integer column of an allowed dtype (aligned columns, the encoder's,
   in loops the compiler vectorises; a fuzzed frame's unaligned ones element by element). */
#define RANGE_OF(T, NAME)                                                                          \
    static void NAME(const char *p, long long count, long long *lo, long long *hi) {              \
        T a, b;                                                                                    \
        if ((uintptr_t)p % sizeof(T) == 0) {                                                       \
            const T *x = (const T *)p;                                                             \
            a = b = x[0];                                                                          \
            for (long long i = 1; i < count; i++) a = x[i] < a ? x[i] : a;                        \
            for (long long i = 1; i < count; i++) b = x[i] > b ? x[i] : b;                        \
        } else {                                                                                   \
            memcpy(&a, p, sizeof(T));                                                              \
            b = a;                                                                                 \
            for (long long i = 1; i < count; i++) {                                                \
                T x;                                                                               \
                memcpy(&x, p + i * (long long)sizeof(T), sizeof(T));                               \
                a = x < a ? x : a;                                                                 \
                b = x > b ? x : b;                                                                 \
            }                                                                                      \
        }                                                                                          \
        *lo = (long long)a;                                                                        \
        *hi = (long long)b;                                                                        \
    }
#if !defined(__SSE2__)
RANGE_OF(int32_t, range_i4)
#endif
RANGE_OF(int64_t, range_i8)
RANGE_OF(int8_t, range_i1)
RANGE_OF(int16_t, range_i2)
RANGE_OF(uint8_t, range_u1)
RANGE_OF(uint16_t, range_u2)
#undef RANGE_OF

#if defined(__SSE2__)
/* The vector loops' end: ``lanes`` holds ``width`` minima then ``width`` maxima of the entries before
   ``i``; the entries from ``i`` on are folded in one by one. */
static void finish_range_i4(const int32_t *lanes, int width, const char *p, long long i, long long count,
                            long long *lo, long long *hi) {
    int32_t a = lanes[0], b = lanes[width];
    for (int k = 1; k < width; k++) {
        a = lanes[k] < a ? lanes[k] : a;
        b = lanes[width + k] > b ? lanes[width + k] : b;
    }
    for (; i < count; i++) {
        int32_t x;
        memcpy(&x, p + 4 * i, 4);
        a = x < a ? x : a;
        b = x > b ? x : b;
    }
    *lo = a;
    *hi = b;
}
#endif

#if defined(__SSE2__)
/* int32 (the versions' usual dtype) four lanes at a time: SSE2 has no pminsd, so compare and select */
static void range_i4(const char *p, long long count, long long *lo, long long *hi) {
    int32_t lanes[8];
    if (count < 8) {
        memcpy(lanes, p, 4); /* one lane: the first entry is both the least and the greatest so far */
        lanes[1] = lanes[0];
        finish_range_i4(lanes, 1, p, 1, count, lo, hi);
        return;
    }
    __m128i mn = _mm_loadu_si128((const __m128i *)p), mx = mn;
    long long i;
    for (i = 4; i + 4 <= count; i += 4) {
        __m128i x = _mm_loadu_si128((const __m128i *)(p + 4 * i));
        __m128i less = _mm_cmplt_epi32(x, mn), more = _mm_cmpgt_epi32(x, mx);
        mn = _mm_or_si128(_mm_and_si128(less, x), _mm_andnot_si128(less, mn));
        mx = _mm_or_si128(_mm_and_si128(more, x), _mm_andnot_si128(more, mx));
    }
    _mm_storeu_si128((__m128i *)lanes, mn);
    _mm_storeu_si128((__m128i *)(lanes + 4), mx);
    finish_range_i4(lanes, 4, p, i, count, lo, hi);
}
#endif

#if defined(__x86_64__) && defined(__GNUC__) && defined(__SSE2__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
static int has_avx2;  /* set at import: the CPU runs AVX2 (the build's flags assume no more than SSE2) */
static int avoid_avx2; /* use_avx2(False): the SSE2 loop instead, so tests run both where AVX2 is */

/* int32 eight lanes at a time, two accumulators deep: a group's versions at 1K tokens x 8 samples are
   8192 entries, which the SSE2 loop above scans in ~2.5 us and this one in well under 1 */
__attribute__((target("avx2"))) static void range_i4_avx2(const char *p, long long count, long long *lo,
                                                           long long *hi) {
    if (count < 16) {
        range_i4(p, count, lo, hi);
        return;
    }
    int32_t lanes[16];
    __m256i mn0 = _mm256_loadu_si256((const __m256i *)p), mx0 = mn0, mn1 = mn0, mx1 = mn0;
    long long i = 0;
    for (; i + 16 <= count; i += 16) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(p + 4 * i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(p + 4 * i + 32));
        mn0 = _mm256_min_epi32(mn0, x0);
        mx0 = _mm256_max_epi32(mx0, x0);
        mn1 = _mm256_min_epi32(mn1, x1);
        mx1 = _mm256_max_epi32(mx1, x1);
    }
    _mm256_storeu_si256((__m256i *)lanes, _mm256_min_epi32(mn0, mn1));
    _mm256_storeu_si256((__m256i *)(lanes + 8), _mm256_max_epi32(mx0, mx1));
    finish_range_i4(lanes, 8, p, i, count, lo, hi);
}
#endif

static void int_range(const char *p, long long count, const char *dtype, long long *lo, long long *hi) {
#ifdef HAVE_AVX2_PATH
    if (has_avx2 && !avoid_avx2 && !strcmp(dtype, "<i4")) {
        range_i4_avx2(p, count, lo, hi);
        return;
    }
#endif
    if (!strcmp(dtype, "<i4")) range_i4(p, count, lo, hi);
    else if (!strcmp(dtype, "<i8")) range_i8(p, count, lo, hi);
    else if (!strcmp(dtype, "|i1")) range_i1(p, count, lo, hi);
    else if (!strcmp(dtype, "<i2")) range_i2(p, count, lo, hi);
    else if (!strcmp(dtype, "|u1")) range_u1(p, count, lo, hi);
    else if (!strcmp(dtype, "<u2")) range_u2(p, count, lo, hi);
}

/* layout()'s checks on a buffer already held; ``spec`` gets where each array lies. */
static PyObject *layout_of(const char *buf, long long size, Py_ssize_t data_start, Py_ssize_t n,
                           PyObject *arrays, int want_versions, Spec *spec) {
    PyObject *result = NULL, *specs = PyDict_New(), *plens = NULL, *rlens = NULL, *rewards = NULL;
    const char *dtype_str[NUM_KNOWN] = {0};
    memset(spec, 0, NUM_KNOWN * sizeof(Spec));
    if (!specs) goto fail;

    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(arrays, &pos, &key, &value)) {
        PyObject *index = PyUnicode_CheckExact(key) ? PyDict_GetItemWithError(known_index, key) : NULL;
        if (!index) goto reject;
        int a = (int)PyLong_AsLong(index);
        if (!PyList_CheckExact(value) || PyList_GET_SIZE(value) != 3) goto reject;
        PyObject *dt = PyList_GET_ITEM(value, 0);
        PyObject *dtype = PyUnicode_CheckExact(dt) ? PyDict_GetItemWithError(dtype_objs, dt) : NULL;
        if (!dtype) goto reject;
        long long count, offset;
        if (!as_count(PyList_GET_ITEM(value, 1), &count) || !as_count(PyList_GET_ITEM(value, 2), &offset))
            goto reject;
        const char *ds = PyUnicode_AsUTF8(dt);
        if (!ds) goto reject;
        long long begin = data_start + offset;
        if (offset > size || count > size || begin + count * size_of(ds) > size) goto reject;
        spec[a] = (Spec){1, dtype, count, begin, size_of(ds)};
        dtype_str[a] = ds;
        PyObject *entry = Py_BuildValue("(OLL)", dtype, count, begin);
        if (!entry || PyDict_SetItem(specs, key, entry) < 0) { Py_XDECREF(entry); goto fail; }
        Py_DECREF(entry);
    }
    for (int a = 0; a < LOSS_MASK; a++)
        if (!spec[a].present) goto reject;
    if (strcmp(dtype_str[REWARDS], "<f8") || strcmp(dtype_str[PROMPT_LENS], "<i4") ||
        strcmp(dtype_str[RESPONSE_LENS], "<i4") || strcmp(dtype_str[SAMPLE_INFO], "|u1"))
        goto reject;
    if (spec[REWARDS].count != n || spec[PROMPT_LENS].count != n || spec[RESPONSE_LENS].count != n)
        goto reject;
    char vkind = kind_of(dtype_str[VERSIONS]);
    if (vkind != 'i' && vkind != 'u') goto reject;

    long long prompt_tokens = 0, response_tokens = 0;
    plens = PyTuple_New(n);
    rlens = PyTuple_New(n);
    rewards = PyTuple_New(n);
    if (!plens || !rlens || !rewards) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int p = load_i32(buf + spec[PROMPT_LENS].begin + 4 * i);
        int r = load_i32(buf + spec[RESPONSE_LENS].begin + 4 * i);
        double w;
        memcpy(&w, buf + spec[REWARDS].begin + 8 * i, 8);
        if (p < 0 || r < 0 || !isfinite(w)) goto reject;
        prompt_tokens += p;
        response_tokens += r;
        PyObject *po = PyLong_FromLong(p), *ro = PyLong_FromLong(r), *wo = PyFloat_FromDouble(w);
        if (!po || !ro || !wo) { Py_XDECREF(po); Py_XDECREF(ro); Py_XDECREF(wo); goto fail; }
        PyTuple_SET_ITEM(plens, i, po);
        PyTuple_SET_ITEM(rlens, i, ro);
        PyTuple_SET_ITEM(rewards, i, wo);
    }
    if (spec[PROMPT_IDS].count != prompt_tokens) goto reject;
    for (int a = RESPONSE_IDS; a <= LOSS_MASK; a++)
        if (spec[a].present && spec[a].count != response_tokens) goto reject;

    long long lo = 0, hi = 0;
    if (want_versions && spec[VERSIONS].count > 0)
        int_range(buf + spec[VERSIONS].begin, spec[VERSIONS].count, dtype_str[VERSIONS], &lo, &hi);
    result = Py_BuildValue("(NNNNLL)", specs, plens, rlens, rewards, lo, hi);
    specs = plens = rlens = rewards = NULL;
    goto done;
reject:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    Py_XDECREF(specs);
    Py_XDECREF(plens);
    Py_XDECREF(rlens);
    Py_XDECREF(rewards);
    return result;
}

static PyObject *layout(PyObject *self, PyObject *args) {
    PyObject *bufobj, *arrays;
    Py_ssize_t data_start, n;
    int want_versions;
    if (!PyArg_ParseTuple(args, "OnnO!p", &bufobj, &data_start, &n, &PyDict_Type, &arrays, &want_versions))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    Spec spec[NUM_KNOWN];
    PyObject *result = layout_of(view.buf, view.len, data_start, n, arrays, want_versions, spec);
    PyBuffer_Release(&view);
    return result;
}

/* ---- samples: decode_group's Sample objects, views into the columns ---- */

static PyObject *samples_of(PyObject *cls, PyObject *prompt_ids, PyObject *response_ids, PyObject *logprobs,
                            PyObject *versions, PyObject *mask, PyObject *plens, PyObject *rlens,
                            PyObject *rewards, PyObject *reasons, PyObject *metas) {
    Py_ssize_t n = PyTuple_GET_SIZE(plens);
    if (PyTuple_GET_SIZE(rlens) != n || PyTuple_GET_SIZE(rewards) != n || PyList_GET_SIZE(reasons) != n ||
        PyList_GET_SIZE(metas) != n) {
        PyErr_SetString(PyExc_ValueError, "samples: every per-sample sequence must have n entries");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *empty = PyTuple_New(0), *out = PyList_New(n);
    if (!empty || !out) goto fail;
    Py_ssize_t p0 = 0, r0 = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t p1 = p0 + PyLong_AsSsize_t(PyTuple_GET_ITEM(plens, i));
        Py_ssize_t r1 = r0 + PyLong_AsSsize_t(PyTuple_GET_ITEM(rlens, i));
        if (PyErr_Occurred()) goto fail;
        PyObject *obj = type->tp_new(type, empty, NULL);
        if (!obj) goto fail;
        PyList_SET_ITEM(out, i, obj);
        PyObject *meta = PyList_GET_ITEM(metas, i);
        PyObject *values[8] = {
            PySequence_GetSlice(prompt_ids, p0, p1),
            PySequence_GetSlice(response_ids, r0, r1),
            PySequence_GetSlice(logprobs, r0, r1),
            PySequence_GetSlice(versions, r0, r1),
            Py_NewRef(PyTuple_GET_ITEM(rewards, i)),
            PyObject_Str(PyList_GET_ITEM(reasons, i)),
            mask == Py_None ? Py_NewRef(Py_None) : PySequence_GetSlice(mask, r0, r1),
            PyDict_Check(meta) ? Py_NewRef(meta) : PyDict_New(),
        };
        static const int order[8] = {PROMPT_IDS, RESPONSE_IDS, LOGPROBS, VERSIONS, -1, -2, LOSS_MASK, -3};
        int ok = 1;
        for (int k = 0; k < 8; k++) {
            PyObject *name = order[k] >= 0 ? name_objs[order[k]]
                             : order[k] == -1 ? s_reward
                             : order[k] == -2 ? s_finish_reason
                                              : s_meta;
            if (!values[k] || (ok && PyObject_SetAttr(obj, name, values[k]) < 0)) ok = 0;
            Py_XDECREF(values[k]);
        }
        if (!ok) goto fail;
        p0 = p1;
        r0 = r1;
    }
    Py_DECREF(empty);
    return out;
fail:
    Py_XDECREF(empty);
    Py_XDECREF(out);
    return NULL;
}

/* ---- crc32_combine: the CRC-32 of two byte strings joined, from the CRC of each ---- */

/* zlib's CRC-32 (reflected polynomial 0xEDB88320) is linear over GF(2): the CRC of A + B is the CRC of A
   carried through len(B) zero bytes, xor the CRC of B. Carrying a CRC through n zero bytes multiplies it by
   x^(8n) modulo the polynomial, which takes log2(n) squarings. The broker uses it to have a group's frame
   CRC and its PACKED record's CRC from one pass over the frame (state.py). */

#define CRC_POLY 0xedb88320u

static uint32_t gf2_multiply(uint32_t a, uint32_t b) { /* a * b modulo the polynomial, reflected bits */
    uint32_t product = 0;
    for (uint32_t bit = 0x80000000u; bit; bit >>= 1) {
        if (a & bit) product ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return product;
}

static uint32_t x_power[64]; /* x^(2^k) modulo the polynomial, reflected: filled at import */

static void fill_x_powers(void) {
    x_power[0] = 0x40000000u; /* x^1 */
    for (int k = 1; k < 64; k++) x_power[k] = gf2_multiply(x_power[k - 1], x_power[k - 1]);
}

static uint32_t x_to_8n(unsigned long long n) { /* x^(8n) modulo the polynomial */
    uint32_t result = 0x80000000u; /* 1 */
    for (int k = 3; n; k++, n >>= 1)
        if (n & 1) result = gf2_multiply(x_power[k], result);
    return result;
}

static PyObject *crc32_combine(PyObject *self, PyObject *args) {
    unsigned long first, second;
    unsigned long long second_len;
    if (!PyArg_ParseTuple(args, "kkK", &first, &second, &second_len)) return NULL;
    if (first > 0xffffffffUL || second > 0xffffffffUL || second_len >> 60) {
        PyErr_SetString(PyExc_ValueError, "crc32_combine: CRCs are 32-bit values and lengths below 2**60");
        return NULL;
    }
    uint32_t crc = gf2_multiply(x_to_8n(second_len), (uint32_t)first) ^ (uint32_t)second;
    return PyLong_FromUnsignedLong(crc);
}

/* ---- gather: the journal's records copied into its staging buffer in one call ---- */

/* A commit's records are a header and a few pieces each (a PACKED group is five): copied one by one from
   Python, each piece cost more than its bytes (journal_writers.DirectWriter). Large copies run without the
   GIL: with the writer thread, the event loop keeps serving meanwhile. */
#define GATHER_WITHOUT_GIL (64 << 10)

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *dest, *parts, *result = NULL;
    Py_ssize_t at, n = 0, got = 0, total = 0;
    Py_buffer out = {0}, *views = NULL;
    if (!PyArg_ParseTuple(args, "OnO", &dest, &at, &parts)) return NULL;
    PyObject *seq = PySequence_Fast(parts, "gather: parts must be a sequence of buffers");
    if (!seq) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (PyObject_GetBuffer(dest, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        total += views[got].len;
    }
    if (at < 0 || at > out.len || total > out.len - at) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    char *to = (char *)out.buf + at;
    if (total >= GATHER_WITHOUT_GIL) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(to, views[i].buf, (size_t)views[i].len);
            to += views[i].len;
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(to, views[i].buf, (size_t)views[i].len);
            to += views[i].len;
        }
    }
    result = PyLong_FromSsize_t(at + total);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    if (out.obj) PyBuffer_Release(&out);
    Py_DECREF(seq);
    return result;
}

/* ---- address: where a buffer's bytes lie (local_memory.frame_address; numpy's way took ~3 us) ---- */

static PyObject *address(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *out = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return out;
}

/* ---- unpack: msgpack.unpackb(raw=False) for the forms group frames carry ---- */

/* A frame's header and its sample_info column are small msgpack maps whose keys (and many short values:
   dtypes, finish reasons, data sources) repeat in every group. msgpack makes a new str for each; this
   decoder keeps short ASCII strings in a small cache and hands out the same (immutable) object, whose
   hash is computed once. Anything outside the common forms (ext types, map keys that are not strings,
   invalid UTF-8, trailing bytes, truncation, nesting deeper than MAX_DEPTH) returns NotImplemented and
   the caller runs msgpack, which decodes it or raises its error: the result is always msgpack's. */

#define STR_CACHE_SLOTS 1024
#define STR_CACHE_MAX_LEN 40
#define MAX_DEPTH 32

static PyObject *str_cache[STR_CACHE_SLOTS];

typedef struct {
    const unsigned char *p, *end;
} Reader;

static PyObject *short_str(const unsigned char *s, Py_ssize_t n) {
    uint32_t h = 2166136261u;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] >= 0x80) return PyUnicode_DecodeUTF8((const char *)s, n, NULL);
        h = (h ^ s[i]) * 16777619u;
    }
    PyObject **slot = &str_cache[(h ^ (uint32_t)n) % STR_CACHE_SLOTS];
    PyObject *hit = *slot;
    if (hit && PyUnicode_GET_LENGTH(hit) == n && memcmp(PyUnicode_DATA(hit), s, (size_t)n) == 0)
        return Py_NewRef(hit);
    PyObject *str = PyUnicode_New(n, 127);
    if (!str) return NULL;
    memcpy(PyUnicode_DATA(str), s, (size_t)n);
    Py_XSETREF(*slot, Py_NewRef(str));
    return str;
}

/* NotImplemented (a new reference) where msgpack must decide; NULL with an exception set on memory
   errors only. */
static PyObject *unpack_one(Reader *r, int depth);

static int need(Reader *r, Py_ssize_t n) { return r->end - r->p >= n; }

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static PyObject *not_mine(void) { return Py_NewRef(Py_NotImplemented); }

static PyObject *unpack_str(Reader *r, Py_ssize_t n) {
    if (!need(r, n)) return not_mine();
    const unsigned char *s = r->p;
    r->p += n;
    PyObject *out = n <= STR_CACHE_MAX_LEN ? short_str(s, n) : PyUnicode_DecodeUTF8((const char *)s, n, NULL);
    if (!out && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        return not_mine();
    }
    return out;
}

static PyObject *unpack_array(Reader *r, Py_ssize_t n, int depth) {
    if (n > r->end - r->p) return not_mine(); /* every item takes a byte at least */
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = unpack_one(r, depth + 1);
        if (!item || item == Py_NotImplemented) {
            Py_DECREF(list);
            return item;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *unpack_map(Reader *r, Py_ssize_t n, int depth) {
    if (n > (r->end - r->p) / 2) return not_mine();
    PyObject *map = PyDict_New();
    if (!map) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = unpack_one(r, depth + 1);
        if (!key || key == Py_NotImplemented) {
            Py_DECREF(map);
            return key;
        }
        if (!PyUnicode_CheckExact(key) && !PyBytes_CheckExact(key)) { /* msgpack's strict_map_key refuses */
            Py_DECREF(key);
            Py_DECREF(map);
            return not_mine();
        }
        PyObject *value = unpack_one(r, depth + 1);
        if (!value || value == Py_NotImplemented) {
            Py_DECREF(key);
            Py_DECREF(map);
            return value;
        }
        int err = PyDict_SetItem(map, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (err < 0) {
            Py_DECREF(map);
            return NULL;
        }
    }
    return map;
}

static PyObject *unpack_one(Reader *r, int depth) {
    if (depth > MAX_DEPTH || !need(r, 1)) return not_mine();
    unsigned char c = *r->p++;
    if (c <= 0x7f) return PyLong_FromLong(c);
    if (c >= 0xe0) return PyLong_FromLong((int8_t)c);
    if ((c & 0xf0) == 0x80) return unpack_map(r, c & 0x0f, depth);
    if ((c & 0xf0) == 0x90) return unpack_array(r, c & 0x0f, depth);
    if ((c & 0xe0) == 0xa0) return unpack_str(r, c & 0x1f);
    static const int widths[] = {
        [0xc4 - 0xc4] = 1, [0xc5 - 0xc4] = 2, [0xc6 - 0xc4] = 4,  /* bin */
        [0xca - 0xc4] = 4, [0xcb - 0xc4] = 8,                     /* float */
        [0xcc - 0xc4] = 1, [0xcd - 0xc4] = 2, [0xce - 0xc4] = 4, [0xcf - 0xc4] = 8, /* uint */
        [0xd0 - 0xc4] = 1, [0xd1 - 0xc4] = 2, [0xd2 - 0xc4] = 4, [0xd3 - 0xc4] = 8, /* int */
        [0xd9 - 0xc4] = 1, [0xda - 0xc4] = 2, [0xdb - 0xc4] = 4,  /* str */
        [0xdc - 0xc4] = 2, [0xdd - 0xc4] = 4, [0xde - 0xc4] = 2, [0xdf - 0xc4] = 4, /* array, map */
    };
    switch (c) {
    case 0xc0: Py_RETURN_NONE;
    case 0xc2: Py_RETURN_FALSE;
    case 0xc3: Py_RETURN_TRUE;
    }
    if (c < 0xc4 || c > 0xdf || !widths[c - 0xc4]) return not_mine(); /* ext, reserved */
    int w = widths[c - 0xc4];
    if (!need(r, w)) return not_mine();
    uint64_t v = be(r->p, w);
    r->p += w;
    switch (c) {
    case 0xc4: case 0xc5: case 0xc6:
        if (!need(r, (Py_ssize_t)v)) return not_mine();
        r->p += v;
        return PyBytes_FromStringAndSize((const char *)r->p - v, (Py_ssize_t)v);
    case 0xca: {
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, 4);
        return PyFloat_FromDouble(f);
    }
    case 0xcb: {
        double d;
        memcpy(&d, &v, 8);
        return PyFloat_FromDouble(d);
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: return PyLong_FromUnsignedLongLong(v);
    case 0xd0: return PyLong_FromLong((int8_t)v);
    case 0xd1: return PyLong_FromLong((int16_t)v);
    case 0xd2: return PyLong_FromLong((int32_t)v);
    case 0xd3: return PyLong_FromLongLong((int64_t)v);
    case 0xd9: case 0xda: case 0xdb: return unpack_str(r, (Py_ssize_t)v);
    case 0xdc: case 0xdd: return unpack_array(r, (Py_ssize_t)v, depth);
    default: return unpack_map(r, (Py_ssize_t)v, depth); /* 0xde, 0xdf */
    }
}

static PyObject *unpack(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Reader r = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *out = unpack_one(&r, 0);
    if (out && out != Py_NotImplemented && r.p != r.end) { /* extra data: msgpack says so */
        Py_DECREF(out);
        out = not_mine();
    }
    PyBuffer_Release(&view);
    return out;
}

/* ---- decode: decode_group in one call ---- */

/* A uint8-array view of bytes [begin, begin + nbytes) of ``u8`` as ``dtype`` (what _Frame.column makes). */
static PyObject *column_view(PyObject *u8, long long begin, long long nbytes, PyObject *dtype) {
    PyObject *lo = PyLong_FromLongLong(begin), *hi = PyLong_FromLongLong(begin + nbytes);
    PyObject *slice = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
    PyObject *part = slice ? PyObject_GetItem(u8, slice) : NULL;
    PyObject *out = part ? PyObject_CallMethodOneArg(part, s_view, dtype) : NULL;
    Py_XDECREF(slice);
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    Py_XDECREF(part);
    return out;
}

/* The header of the frame ``buf``: sets *header (a new reference, also where 0 is returned), its id, n and
   arrays (borrowed from it) and where the arrays' data starts. 1 where _Frame's checks of the header hold
   and nothing is left to msgpack; 0 where the Python checks must run instead; -1 on memory errors. */
static int read_header(const char *buf, long long size, PyObject **header, PyObject **gid, Py_ssize_t *n,
                       PyObject **arrays, Py_ssize_t *data_start) {
    *header = NULL;
    if (size < 4) return 0;
    uint32_t hlen;
    memcpy(&hlen, buf, 4);
    if (4 + (long long)hlen > size) return 0;
    Reader r = {(const unsigned char *)buf + 4, (const unsigned char *)buf + 4 + hlen};
    *header = unpack_one(&r, 0);
    if (!*header) return -1;
    if (*header == Py_NotImplemented || r.p != r.end || !PyDict_CheckExact(*header)) return 0;
    *gid = PyDict_GetItemWithError(*header, s_id);
    PyObject *n_obj = *gid ? PyDict_GetItemWithError(*header, s_n) : NULL;
    *arrays = n_obj ? PyDict_GetItemWithError(*header, s_arrays) : NULL;
    if (PyErr_Occurred()) return -1;
    if (!*gid || !PyUnicode_CheckExact(*gid) || !n_obj || !PyLong_CheckExact(n_obj) || !*arrays ||
        !PyDict_CheckExact(*arrays))
        return 0;
    long long n_ll;
    if (!as_count(n_obj, &n_ll) || n_ll < 1 || n_ll > size) return 0; /* _Frame's native path: n <= size */
    *n = (Py_ssize_t)n_ll;
    long long start = 4 + (long long)hlen;
    *data_start = (Py_ssize_t)(start + pad8(start));
    return 1;
}

/* inspect_group's summary of the frame ``buf`` in one call: (group_id, num_samples, rewards, min_version,
   num_tokens, max_version, versions_at), GroupInfo's fields in order; None where codec.py must run. */
static PyObject *inspect(PyObject *self, PyObject *bufobj) {
    Py_buffer view;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL, *header = NULL, *laid = NULL, *rewards = NULL, *gid, *arrays;
    Py_ssize_t n, data_start;
    Spec spec[NUM_KNOWN];
    int read = read_header(view.buf, view.len, &header, &gid, &n, &arrays, &data_start);
    if (read < 0) goto fail;
    if (read == 0) goto reject;
    laid = layout_of(view.buf, view.len, data_start, n, arrays, 1, spec);
    if (!laid) goto fail;
    if (laid == Py_None) goto reject;
    rewards = PySequence_List(PyTuple_GET_ITEM(laid, 3));
    if (!rewards) goto fail;
    Spec *v = &spec[VERSIONS];
    result = Py_BuildValue("(OnOOLO(LLO))", gid, n, rewards, PyTuple_GET_ITEM(laid, 4), spec[RESPONSE_IDS].count,
                           PyTuple_GET_ITEM(laid, 5), v->begin, v->count, v->dtype);
    goto done;
reject:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    PyBuffer_Release(&view);
    Py_XDECREF(header);
    Py_XDECREF(laid);
    Py_XDECREF(rewards);
    return result;
}

/* The Group decode_group returns for the frame ``buf`` (a contiguous bytes-like object), built as
   codec.py's path builds it; None wherever that path must run instead (any rule it checks fails, or the
   frame takes a form this code leaves to it), so its error and message are the ones raised. */
static PyObject *decode(PyObject *self, PyObject *args) {
    PyObject *bufobj, *sample_cls, *group_cls;
    if (!PyArg_ParseTuple(args, "OO!O!", &bufobj, &PyType_Type, &sample_cls, &PyType_Type, &group_cls))
        return NULL;
    if (!np_frombuffer) {
        PyErr_SetString(PyExc_RuntimeError, "decode: configure() first");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *buf = view.buf;
    long long size = view.len;
    PyObject *result = NULL, *header = NULL, *laid = NULL, *info = NULL, *u8 = NULL, *group = NULL;
    PyObject *cols[NUM_COLUMNS] = {0}, *samples_list = NULL, *meta = NULL, *empty = NULL;
    Spec spec[NUM_KNOWN];

    PyObject *gid, *arrays;
    Py_ssize_t n, data_start;
    int read = read_header(buf, size, &header, &gid, &n, &arrays, &data_start);
    if (read < 0) goto fail;
    if (read == 0) goto reject;
    laid = layout_of(buf, size, data_start, n, arrays, 0, spec);
    if (!laid) goto fail;
    if (laid == Py_None) goto reject;
    PyObject *plens = PyTuple_GET_ITEM(laid, 1), *rlens = PyTuple_GET_ITEM(laid, 2),
             *rewards = PyTuple_GET_ITEM(laid, 3);

    Reader ri = {(const unsigned char *)buf + spec[SAMPLE_INFO].begin,
                 (const unsigned char *)buf + spec[SAMPLE_INFO].begin + spec[SAMPLE_INFO].count};
    info = unpack_one(&ri, 0);
    if (!info) goto fail;
    if (info == Py_NotImplemented || ri.p != ri.end || !PyList_CheckExact(info) || PyList_GET_SIZE(info) != 2)
        goto reject;
    PyObject *reasons = PyList_GET_ITEM(info, 0), *metas = PyList_GET_ITEM(info, 1);
    if (!PyList_CheckExact(reasons) || !PyList_CheckExact(metas) || PyList_GET_SIZE(reasons) != n ||
        PyList_GET_SIZE(metas) != n)
        goto reject;

    u8 = PyObject_CallFunctionObjArgs(np_frombuffer, bufobj, np_uint8, NULL);
    if (!u8) goto fail;
    for (int c = 0; c < NUM_COLUMNS; c++) {
        Spec *sp = &spec[FIRST_COLUMN + c];
        if (!sp->present) continue; /* only the loss mask may be absent (layout checked the others) */
        cols[c] = column_view(u8, sp->begin, sp->count * sp->itemsize, sp->dtype);
        if (!cols[c]) goto fail;
    }
    samples_list = samples_of(sample_cls, cols[0], cols[1], cols[2], cols[3], cols[4] ? cols[4] : Py_None,
                              plens, rlens, rewards, reasons, metas);
    if (!samples_list) goto fail;
    PyObject *group_meta = PyDict_GetItemWithError(header, s_meta);
    if (PyErr_Occurred()) goto fail;
    meta = group_meta && PyDict_Check(group_meta) ? Py_NewRef(group_meta) : PyDict_New();
    empty = PyTuple_New(0);
    if (!meta || !empty) goto fail;
    group = ((PyTypeObject *)group_cls)->tp_new((PyTypeObject *)group_cls, empty, NULL);
    if (!group || PyObject_SetAttr(group, s_group_id, gid) < 0 ||
        PyObject_SetAttr(group, s_samples, samples_list) < 0 || PyObject_SetAttr(group, s_meta, meta) < 0)
        goto fail;
    result = Py_NewRef(group);
    goto done;
reject:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
    goto done;
fail:
    result = NULL;
done:
    PyBuffer_Release(&view);
    Py_XDECREF(header);
    Py_XDECREF(laid);
    Py_XDECREF(info);
    Py_XDECREF(u8);
    for (int c = 0; c < NUM_COLUMNS; c++) Py_XDECREF(cols[c]);
    Py_XDECREF(samples_list);
    Py_XDECREF(meta);
    Py_XDECREF(empty);
    Py_XDECREF(group);
    return result;
}

static PyObject *use_avx2(PyObject *self, PyObject *arg) {
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
#ifdef HAVE_AVX2_PATH
    avoid_avx2 = !want;
    return PyBool_FromLong(has_avx2 && want);
#else
    return PyBool_FromLong(0);
#endif
}

/* ---- set-up ---- */

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *dtypes, *empty, *uint8, *frombuffer, *pack;
    if (!PyArg_ParseTuple(args, "O!OOOO", &PyDict_Type, &dtypes, &empty, &uint8, &frombuffer, &pack)) return NULL;
    Py_XSETREF(dtype_objs, Py_NewRef(dtypes));
    Py_XSETREF(np_empty, Py_NewRef(empty));
    Py_XSETREF(np_uint8, Py_NewRef(uint8));
    Py_XSETREF(np_frombuffer, Py_NewRef(frombuffer));
    Py_XSETREF(packb, Py_NewRef(pack));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(dtypes, np.empty, np.uint8, np.frombuffer, msgpack.packb)"},
    {"inspect", inspect, METH_O,
     "inspect(buffer) -> GroupInfo's fields (inspect_group's summary), or None where codec.py must inspect"},
    {"decode", decode, METH_VARARGS,
     "decode(buffer, Sample, Group) -> the Group decode_group returns, or None where codec.py must decode"},
    {"encode", encode, METH_VARARGS,
     "encode(group, alloc, streaming=False) -> frame, or None where codec.py must encode"},
    {"layout", layout, METH_VARARGS,
     "layout(buf, data_start, n, arrays, want_versions) -> (specs, prompt_lens, response_lens, rewards, "
     "vmin, vmax), or None where a rule fails"},
    {"use_avx2", use_avx2, METH_O,
     "use_avx2(flag) -> whether the versions' range is now scanned with AVX2 (only where the CPU has it; "
     "False: the SSE2 loop, for tests)"},
    {"unpack", unpack, METH_O,
     "unpack(buffer) -> msgpack.unpackb(buffer, raw=False), or NotImplemented where msgpack must decode it"},
    {"address", address, METH_O, "address(buffer) -> where the contiguous buffer's bytes start in this process"},
    {"gather", gather, METH_VARARGS,
     "gather(dest, at, parts) -> at + the parts' total length, copied one after the other into the writable "
     "buffer dest from byte at; None (nothing copied) where they do not fit"},
    {"crc32_combine", crc32_combine, METH_VARARGS,
     "crc32_combine(crc_a, crc_b, len_b) -> zlib.crc32(a + b) from zlib.crc32(a) and zlib.crc32(b)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tidal_codec_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tidal_codec_native(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
#endif
    fill_x_powers();
    known_index = PyDict_New();
    if (!known_index) return NULL;
    for (int a = 0; a < NUM_KNOWN; a++) {
        name_objs[a] = PyUnicode_InternFromString(NAMES[a]);
        PyObject *i = PyLong_FromLong(a);
        if (!name_objs[a] || !i || PyDict_SetItem(known_index, name_objs[a], i) < 0) return NULL;
        Py_DECREF(i);
    }
    s_samples = PyUnicode_InternFromString("samples");
    s_group_id = PyUnicode_InternFromString("group_id");
    s_meta = PyUnicode_InternFromString("meta");
    s_reward = PyUnicode_InternFromString("reward");
    s_finish_reason = PyUnicode_InternFromString("finish_reason");
    s_id = PyUnicode_InternFromString("id");
    s_n = PyUnicode_InternFromString("n");
    s_arrays = PyUnicode_InternFromString("arrays");
    s_view = PyUnicode_InternFromString("view");
    if (!s_samples || !s_group_id || !s_meta || !s_reward || !s_finish_reason || !s_id || !s_n || !s_arrays ||
        !s_view)
        return NULL;
    return m;
}
