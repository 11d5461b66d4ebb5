/* The scalar dtype conversions (portable, round to nearest even as torch does) and the tile fill
 * of the float32 / float64 kernels: included once by blockprod.c, after its dtype enum (DT_*). */
/* ------------------------------------------------------------------------------------------ */
/* dtype conversions (scalar, portable; round to nearest even as torch does) */

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            mant &= 0x3ffu;
            u = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow (rounds to inf) */
    if (au < 0x38800000u) { /* subnormal or zero in half */
        if (au < 0x33000000u) return (uint16_t)sign;
        uint32_t e = au >> 23, m = (au & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14 .. 24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = au + 0xfffu + ((au >> 13) & 1u);
    r -= (uint32_t)(127 - 15) << 23;
    return (uint16_t)(sign | (r >> 13));
}

static inline double get_el(const void *p, int dt, int64_t i)
{
    switch (dt) {
    case DT_F32: return ((const float *)p)[i];
    case DT_F64: return ((const double *)p)[i];
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static inline void put_el(void *p, int dt, int64_t i, double v)
{
    switch (dt) {
    case DT_F32: ((float *)p)[i] = (float)v; break;
    case DT_F64: ((double *)p)[i] = v; break;
    case DT_F16: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
    default: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    }
}

/* p[i + t] = v[t] for t < cnt, converted to dt */
static inline void put_row_f(void *p, int dt, int64_t i, const float *v, int64_t cnt)
{
    for (int64_t t = 0; t < cnt; t++) put_el(p, dt, i + t, v[t]);
}
static inline void put_row_d(void *p, int dt, int64_t i, const double *v, int64_t cnt)
{
    for (int64_t t = 0; t < cnt; t++) put_el(p, dt, i + t, v[t]);
}
#define put_row(p, dt, i, v, cnt) _Generic((v), float *: put_row_f, double *: put_row_d)(p, dt, i, v, cnt)

/* buf[k * ld + n] = X[k, n0 + n] (k < n_in, n < nt) in the compute type `cdt` */
static void fill_tile(void *buf, int64_t ld, const void *x, int xdt, int64_t xk, int64_t xn,
                      int64_t n_in, int64_t n0, int64_t nt, int cdt)
{
    if (cdt == DT_F32) {
        float *b = (float *)buf;
        if (xdt == DT_F32) {
            const float *s = (const float *)x;
            for (int64_t n = 0; n < nt; n++) {
                const float *sn = s + (n0 + n) * xn;
                for (int64_t k = 0; k < n_in; k++) b[k * ld + n] = sn[k * xk];
            }
        } else if (xdt == DT_BF16) {
            const uint16_t *s = (const uint16_t *)x;
            for (int64_t n = 0; n < nt; n++) {
                const uint16_t *sn = s + (n0 + n) * xn;
                for (int64_t k = 0; k < n_in; k++) b[k * ld + n] = bf16_to_f32(sn[k * xk]);
            }
        } else {
            for (int64_t n = 0; n < nt; n++)
                for (int64_t k = 0; k < n_in; k++)
                    b[k * ld + n] = (float)get_el(x, xdt, (n0 + n) * xn + k * xk);
        }
    } else {
        double *b = (double *)buf;
        for (int64_t n = 0; n < nt; n++)
            for (int64_t k = 0; k < n_in; k++)
                b[k * ld + n] = get_el(x, xdt, (n0 + n) * xn + k * xk);
    }
}
