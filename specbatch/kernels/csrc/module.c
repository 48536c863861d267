/* The Python module `_specbatch_cpu`: one METH_FASTCALL function per kernel, taking plain
 * ints (data pointers, sizes, strides; None for an absent pointer) and floats, and releasing
 * the GIL while the kernel runs. cpu.py turns tensors into those arguments. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "kernels.h"

typedef union {
    long long i;
    double f;
    void* p;
} arg_t;

/* fmt: one letter per argument: i (int), p (pointer as int, or None), f (float). */
static int parse(PyObject* const* args, Py_ssize_t n, const char* fmt, arg_t* out) {
    Py_ssize_t want = (Py_ssize_t)strlen(fmt);
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject* a = args[k];
        switch (fmt[k]) {
            case 'i':
                out[k].i = PyLong_AsLongLong(a);
                break;
            case 'p':
                out[k].p = a == Py_None ? NULL : PyLong_AsVoidPtr(a);
                break;
            case 'f':
                out[k].f = PyFloat_AsDouble(a);
                break;
        }
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

#define I(k) ((int)a[k].i)
#define L(k) ((long)a[k].i)
#define P(k) (a[k].p)
#define F(k) ((float)a[k].f)

#define WRAP(name, fmt, call)                                                     \
    static PyObject* py_##name(PyObject* self, PyObject* const* args, Py_ssize_t n) { \
        (void)self;                                                               \
        arg_t a[24];                                                              \
        if (parse(args, n, fmt, a) < 0) return NULL;                              \
        Py_BEGIN_ALLOW_THREADS call;                                              \
        Py_END_ALLOW_THREADS Py_RETURN_NONE;                                      \
    }

WRAP(linear_f32, "iiipipppi", sb_linear_f32(I(0), I(1), I(2), P(3), L(4), P(5), P(6), P(7), L(8)))
WRAP(linear_bf16, "iiipipppii",
     sb_linear_bf16(I(0), I(1), I(2), P(3), L(4), P(5), P(6), P(7), L(8), I(9)))
WRAP(set_amx, "i", sb_set_amx(I(0)))
WRAP(rms_norm, "iipippfpi", sb_rms_norm(I(0), I(1), P(2), L(3), P(4), P(5), F(6), P(7), I(8)))
WRAP(head_rms_norm, "iiipipfi", sb_head_rms_norm(I(0), I(1), I(2), P(3), L(4), P(5), F(6), I(7)))
WRAP(rope, "iiipipppi", sb_rope(I(0), I(1), I(2), P(3), L(4), P(5), P(6), P(7), I(8)))
WRAP(silu_and_mul, "iippi", sb_silu_and_mul(I(0), I(1), P(2), P(3), I(4)))
WRAP(write_kv, "iiipipipppii",
     sb_write_kv(I(0), I(1), I(2), P(3), L(4), P(5), L(6), P(7), P(8), P(9), I(10), I(11)))
WRAP(paged_attention, "ipppipiiiippifpppi",
     sb_paged_attention(I(0), P(1), P(2), P(3), L(4), P(5), L(6), I(7), I(8), I(9), P(10), P(11),
                        I(12), F(13), P(14), P(15), P(16), I(17)))

WRAP(sample_rows, "iipipp", sb_sample_rows(I(0), I(1), P(2), L(3), P(4), P(5)))
WRAP(rejection_sample, "iiipppiipiippppp",
     sb_rejection_sample(I(0), I(1), I(2), P(3), P(4), P(5), L(6), L(7), P(8), L(9), L(10), P(11),
                         P(12), P(13), P(14), P(15)))

static PyObject* py_linear_quant(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    (void)self;
    arg_t a[16];
    if (parse(args, n, "iiipiipppii", a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = sb_linear_quant(I(0), I(1), I(2), P(3), L(4), I(5), P(6), P(7),
                                                P(8), L(9), I(10));
    Py_END_ALLOW_THREADS if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, "linear_quant: a type it does not run, or K not whole blocks");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject* py_decoder_layers(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    (void)self;
    arg_t a[24];
    if (parse(args, n, "piiiipppppippipppffi", a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = sb_decoder_layers(
        P(0), I(1), I(2), I(3), I(4), P(5), P(6), P(7), P(8), P(9), I(10), P(11), P(12), P(13),
        L(14), P(15), P(16), F(17), F(18), I(19));
    Py_END_ALLOW_THREADS if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject* py_eagle3_pass(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    (void)self;
    arg_t a[32];
    if (parse(args, n, "pippippppipppppppiiipppippffi", a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = sb_eagle3_pass(
        P(0), I(1), P(2), P(3), L(4), P(5), P(6), P(7), P(8), I(9), P(10), P(11), P(12), P(13),
        P(14), P(15), P(16), I(17), I(18), I(19), P(20), P(21), P(22), L(23), P(24), P(25), F(26),
        F(27), I(28));
    Py_END_ALLOW_THREADS if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* returns the seconds the head's pass over the rows it had not seen took, with the roots */
static PyObject* py_eagle3_round(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    (void)self;
    arg_t a[48];
    if (parse(args, n, "piippiippppipppiipppppppippipipippippiiffi", a) < 0) return NULL;
    int rc;
    double seconds = 0.0;
    Py_BEGIN_ALLOW_THREADS rc = sb_eagle3_round(
        P(0), I(1), I(2), P(3), P(4), L(5), I(6), P(7), P(8), P(9), P(10), I(11), P(12), P(13),
        P(14), L(15), I(16), P(17), P(18), P(19), P(20), P(21), P(22), P(23), I(24), P(25),
        P(26), L(27), P(28), L(29), P(30), L(31), P(32), P(33), L(34), P(35), P(36), I(37),
        I(38), F(39), F(40), I(41), &seconds);
    Py_END_ALLOW_THREADS if (rc != 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(seconds);
}

static PyObject* py_info(PyObject* self, PyObject* unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i}", "bf16_dot", sb_has_bf16_dot(), "amx",
                         sb_amx_available(), "max_head_dim", sb_attention_max_head_dim(), "tree",
                         sb_attention_tree_rows(), "layer_fields", sb_layer_fields(),
                         "stack_fields", sb_stack_fields());
}

#define FAST(name) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, NULL}
static PyMethodDef methods[] = {
    FAST(linear_f32), FAST(linear_bf16), FAST(set_amx), FAST(rms_norm), FAST(head_rms_norm),
    FAST(rope), FAST(silu_and_mul), FAST(write_kv), FAST(paged_attention), FAST(sample_rows),
    FAST(rejection_sample), FAST(decoder_layers), FAST(eagle3_pass), FAST(eagle3_round),
    FAST(linear_quant),
    {"info", py_info, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_specbatch_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__specbatch_cpu(void) { return PyModule_Create(&module); }
