/*
 * hooks_array.c: CUDA arrays (1D/2D/3D, layered, cubemap, mipmapped) and
 * their destroys. An array's bytes are computed from its descriptor:
 * width * height * depth texels times the format's bytes per texel (block
 * formats by 4x4 block), summed over mipmap levels. This is a lower bound of
 * what the driver allocates (it pads for alignment); sparse and
 * deferred-mapping arrays have no memory until mapped (counted at
 * cuMemCreate), so they count zero.
 *
 * Must not: make a syscall or take a lock.
 */
#define _GNU_SOURCE
#include "preload.h"

#define GN_ARRAY3D_LAYERED 0x01u
#define GN_ARRAY3D_CUBEMAP 0x04u
#define GN_ARRAY3D_SPARSE 0x40u
#define GN_ARRAY3D_DEFERRED_MAPPING 0x80u

/* Bytes per texel as a fraction num/den, per channel when per_channel is
 * set; block formats give bytes per 4x4 block. */
struct gn_texel {
    unsigned num, den, per_channel, block;
};

static struct gn_texel gn_texel_of(int format)
{
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
    case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_UNORM_INT8X2:
    case CU_AD_FORMAT_UNORM_INT8X4:
    case CU_AD_FORMAT_SNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X2:
    case CU_AD_FORMAT_SNORM_INT8X4:
        return (struct gn_texel){1, 1, 1, 0};
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
    case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_UNORM_INT16X4:
    case CU_AD_FORMAT_SNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X4:
        return (struct gn_texel){2, 1, 1, 0};
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        return (struct gn_texel){4, 1, 1, 0};
    case CU_AD_FORMAT_BC1_UNORM:
    case CU_AD_FORMAT_BC1_UNORM_SRGB:
    case CU_AD_FORMAT_BC4_UNORM:
    case CU_AD_FORMAT_BC4_SNORM:
        return (struct gn_texel){8, 1, 0, 1};
    case CU_AD_FORMAT_BC2_UNORM:
    case CU_AD_FORMAT_BC2_UNORM_SRGB:
    case CU_AD_FORMAT_BC3_UNORM:
    case CU_AD_FORMAT_BC3_UNORM_SRGB:
    case CU_AD_FORMAT_BC5_UNORM:
    case CU_AD_FORMAT_BC5_SNORM:
    case CU_AD_FORMAT_BC6H_UF16:
    case CU_AD_FORMAT_BC6H_SF16:
    case CU_AD_FORMAT_BC7_UNORM:
    case CU_AD_FORMAT_BC7_UNORM_SRGB:
        return (struct gn_texel){16, 1, 0, 1};
    case CU_AD_FORMAT_NV12:
        return (struct gn_texel){3, 2, 0, 0};
    case CU_AD_FORMAT_NV16:
    case CU_AD_FORMAT_YUY2:
        return (struct gn_texel){2, 1, 0, 0};
    case CU_AD_FORMAT_P010:
    case CU_AD_FORMAT_P016:
    case CU_AD_FORMAT_Y444_PLANAR8:
    case CU_AD_FORMAT_YUV444_8BIT_SEMIPLANAR:
        return (struct gn_texel){3, 1, 0, 0};
    case CU_AD_FORMAT_P210:
    case CU_AD_FORMAT_P216:
    case CU_AD_FORMAT_Y210:
    case CU_AD_FORMAT_Y216:
    case CU_AD_FORMAT_AYUV:
    case CU_AD_FORMAT_Y410:
    case CU_AD_FORMAT_UNORM_INT_101010_2:
        return (struct gn_texel){4, 1, 0, 0};
    case CU_AD_FORMAT_Y444_PLANAR10:
    case CU_AD_FORMAT_YUV444_16BIT_SEMIPLANAR:
        return (struct gn_texel){6, 1, 0, 0};
    case CU_AD_FORMAT_Y416:
        return (struct gn_texel){8, 1, 0, 0};
    default:
        /* Unknown to this build: count the widest known texel (4 x 32-bit). */
        return (struct gn_texel){16, 1, 0, 0};
    }
}

static uint64_t gn_level_bytes(uint64_t w, uint64_t h, uint64_t d, struct gn_texel t, unsigned channels)
{
    uint64_t units, bytes;
    if (t.block) {
        w = (w + 3) / 4;
        h = (h + 3) / 4;
    }
    if (__builtin_mul_overflow(w, h, &units) || __builtin_mul_overflow(units, d, &units))
        return UINT64_MAX;
    if (t.per_channel && __builtin_mul_overflow(units, (uint64_t)channels, &units))
        return UINT64_MAX;
    if (__builtin_mul_overflow(units, (uint64_t)t.num, &bytes))
        return UINT64_MAX;
    return (bytes + t.den - 1) / t.den;
}

uint64_t gn_array_bytes(uint64_t width, uint64_t height, uint64_t depth, int format, unsigned channels,
                        unsigned flags, unsigned levels)
{
    if (flags & (GN_ARRAY3D_SPARSE | GN_ARRAY3D_DEFERRED_MAPPING))
        return 0;
    struct gn_texel t = gn_texel_of(format);
    uint64_t w = width ? width : 1, h = height ? height : 1, d = depth ? depth : 1;
    unsigned c = channels ? channels : 1;
    int depth_is_layers = (flags & (GN_ARRAY3D_LAYERED | GN_ARRAY3D_CUBEMAP)) != 0;
    uint64_t total = 0;
    for (unsigned level = 0; level < (levels ? levels : 1); level++) {
        uint64_t bytes = gn_level_bytes(w, h, d, t, c);
        if (bytes == UINT64_MAX || __builtin_add_overflow(total, bytes, &total))
            return UINT64_MAX;
        if (w == 1 && h == 1 && (d == 1 || depth_is_layers))
            break;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : 1;
        if (!depth_is_layers)
            d = d > 1 ? d / 2 : 1;
    }
    return total;
}

/* The four array creators differ only in their descriptor's type and
 * whether it has a depth and flags. */
#define GN_ARRAY_CREATE(name, desc_type, depth, flags)                                                             \
    GN_EXPORT CUresult name(CUarray *array, const desc_type *desc)                                                 \
    {                                                                                                              \
        __typeof__(&name) real = GN_REAL(name);                                                                    \
        if (GN_UNLIKELY(!real))                                                                                    \
            return gn_missing(GN_ID_##name);                                                                       \
        if (!desc || !array)                                                                                       \
            return real(array, desc);                                                                              \
        uint64_t bytes = gn_array_bytes(desc->Width, desc->Height, (depth), desc->Format, desc->NumChannels,       \
                                        (flags), 1);                                                               \
        struct gn_alloc a;                                                                                         \
        if (!gn_alloc_begin(&a, GN_KIND_ARRAY, bytes, -1, __func__))                                               \
            return a.refused;                                                                                      \
        return gn_alloc_end(&a, real(array, desc), array, sizeof *array);                                          \
    }

GN_ARRAY_CREATE(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, 1, 0)
GN_ARRAY_CREATE(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 1, 0)
GN_ARRAY_CREATE(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1, desc->Depth, desc->Flags)
GN_ARRAY_CREATE(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, desc->Depth, desc->Flags)

GN_EXPORT CUresult cuArrayDestroy(CUarray array)
{
    __typeof__(&cuArrayDestroy) real = GN_REAL(cuArrayDestroy);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuArrayDestroy);
    uint64_t key = (uint64_t)(uintptr_t)array;
    uint64_t val = gn_free_begin(key, GN_KIND_ARRAY);
    return gn_free_end(real(array), key, val);
}

GN_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                          unsigned int levels)
{
    __typeof__(&cuMipmappedArrayCreate) real = GN_REAL(cuMipmappedArrayCreate);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMipmappedArrayCreate);
    if (!desc || !array)
        return real(array, desc, levels);
    uint64_t bytes =
        gn_array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels, desc->Flags, levels);
    struct gn_alloc a;
    if (!gn_alloc_begin(&a, GN_KIND_MIPMAP, bytes, -1, __func__))
        return a.refused;
    return gn_alloc_end(&a, real(array, desc, levels), array, sizeof *array);
}

GN_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array)
{
    __typeof__(&cuMipmappedArrayDestroy) real = GN_REAL(cuMipmappedArrayDestroy);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMipmappedArrayDestroy);
    uint64_t key = (uint64_t)(uintptr_t)array;
    uint64_t val = gn_free_begin(key, GN_KIND_MIPMAP);
    return gn_free_end(real(array), key, val);
}
